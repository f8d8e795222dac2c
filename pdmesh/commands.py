"""`pdmesh up`, `pdmesh generate`, `pdmesh workers`: the local mesh and its clients."""

from __future__ import annotations

import argparse
import importlib.util
import signal
import sys
import time

from pdmesh.cli import command
from pdmesh.launcher import Launcher, LaunchError, RunningService, ServiceSpec, flags

DEFAULT_ROUTER = "127.0.0.1:50051"
SERVICES = {
    "kvtransfer": ("services.kvtransfer.main", "pdmesh.v1.KvTransferService"),
    "prefill": ("services.prefill.main", "pdmesh.v1.PrefillService"),
    "decode": ("services.decode.main", "pdmesh.v1.DecodeService"),
    "router": ("services.router.main", "pdmesh.v1.RouterService"),
}


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--host", default="127.0.0.1", help="address every service listens on")
    p.add_argument(
        "--router-port", type=int, default=50051, help="the router's public port (0 = any free port)"
    )
    p.add_argument(
        "--gateway-port",
        type=int,
        default=8000,
        help="the OpenAI-compatible HTTP gateway's port (0 = any free port)",
    )
    p.add_argument("--model", default=None, help="Hugging Face model folder (default: the built-in model)")
    p.add_argument("--preset", default="tiny", help="built-in model preset when no --model (tiny, small)")
    p.add_argument(
        "--max-local-prefill-tokens",
        type=int,
        default=None,
        help="decode workers prefill locally at or below this many uncached prompt tokens",
    )
    p.add_argument("--kv-transport", default="nixl", choices=("nixl", "grpc"))
    p.add_argument("--engine-threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--policy", default=None, help="router policy: kv_aware, least_loaded, round_robin")
    p.add_argument("--workdir", default=None, help="where logs and port files go (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for each service")


def mesh_specs(args: argparse.Namespace) -> list[ServiceSpec]:
    """The topology `pdmesh up` starts, in start order (kvtransfer address filled in later)."""
    engine = flags(
        engine_model_path=args.model,
        engine_preset=None if args.model else args.preset,
        engine_num_threads=args.engine_threads,
    )
    specs = [
        ServiceSpec(
            "kvtransfer",
            SERVICES["kvtransfer"][0],
            flags(host=args.host),
            ready_service=SERVICES["kvtransfer"][1],
            host=args.host,
        )
    ]
    for i in range(args.prefill):
        specs.append(
            ServiceSpec(
                f"prefill-{i}",
                SERVICES["prefill"][0],
                flags(host=args.host, worker_id=f"prefill-{i}", kv_transport=args.kv_transport) + engine,
                ready_service=SERVICES["prefill"][1],
                host=args.host,
            )
        )
    for i in range(args.decode):
        specs.append(
            ServiceSpec(
                f"decode-{i}",
                SERVICES["decode"][0],
                flags(
                    host=args.host,
                    worker_id=f"decode-{i}",
                    kv_transport=args.kv_transport,
                    max_local_prefill_tokens=args.max_local_prefill_tokens,
                )
                + engine,
                ready_service=SERVICES["decode"][1],
                host=args.host,
            )
        )
    return specs


def start_mesh(launcher: Launcher, args: argparse.Namespace, say=print) -> dict[str, RunningService]:
    """Start kvtransfer, prefill, decode (and the router when it exists); wait for each."""
    started: dict[str, RunningService] = {}
    specs = mesh_specs(args)
    kv = launcher.start_ready(specs[0], args.timeout)
    started[kv.spec.name] = kv
    say(f"  kvtransfer   {kv.address}  SERVING")
    prefills = [
        launcher.start(_with(s, kvtransfer_address=kv.address)) for s in specs if s.name.startswith("prefill")
    ]
    for svc in prefills:
        launcher.wait_ready(svc, args.timeout)
        started[svc.spec.name] = svc
        say(f"  {svc.spec.name:<12} {svc.address}  SERVING")
    prefill_addrs = [s.address for s in prefills]
    decodes = [
        launcher.start(_with(s, kvtransfer_address=kv.address, prefill_workers=prefill_addrs or None))
        for s in specs
        if s.name.startswith("decode")
    ]
    for svc in decodes:
        launcher.wait_ready(svc, args.timeout)
        started[svc.spec.name] = svc
        say(f"  {svc.spec.name:<12} {svc.address}  SERVING")
    if _exists(SERVICES["router"][0]):
        router = launcher.start_ready(
            ServiceSpec(
                "router",
                SERVICES["router"][0],
                flags(
                    host=args.host,
                    port=args.router_port,
                    decode_workers=[d.address for d in decodes],
                    prefill_workers=prefill_addrs or None,
                    policy=args.policy,
                    preset=None if args.model else args.preset,
                    model_path=args.model,
                ),
                ready_service=SERVICES["router"][1],
                host=args.host,
            ),
            args.timeout,
        )
        started["router"] = router
        say(f"  router       {router.address}  SERVING")
        if _exists("services.gateway.main"):
            from services.gateway.launch import gateway_spec, start_ready

            gateway = start_ready(
                launcher,
                gateway_spec(
                    router.address,
                    host=args.host,
                    port=args.gateway_port,
                    model_path=args.model,
                    preset=None if args.model else args.preset,
                ),
                args.timeout,
            )
            started["gateway"] = gateway
            say(f"  gateway      http://{gateway.address}/v1  SERVING")
    return started


def _with(spec: ServiceSpec, **extra: object) -> ServiceSpec:
    return ServiceSpec(
        spec.name, spec.module, spec.args + flags(**extra), spec.env, spec.ready_service, spec.host
    )


@command("up", _up_args)
def up(args: argparse.Namespace) -> int:
    """Start a local mesh (kvtransfer, prefill, decode, router) and serve until Ctrl-C."""
    launcher = Launcher(args.workdir)
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    print(f"pdmesh up: starting (logs in {launcher.workdir})", flush=True)
    try:
        started = start_mesh(launcher, args, say=lambda s: print(s, flush=True))
        entry = started.get("router") or next(s for n, s in started.items() if n.startswith("decode"))
        kind = "router" if "router" in started else "decode worker (no router yet)"
        print(
            f"pdmesh up: serving on {entry.address} ({kind}); try: pdmesh generate --address {entry.address} "
            f'"Hello"   (Ctrl-C to stop)',
            flush=True,
        )
        while not stop["now"]:
            for svc in launcher.services:
                if svc.proc.poll() is not None:
                    print(
                        f"pdmesh up: {svc.spec.name} exited ({svc.proc.returncode}); stopping\n{svc.log_tail()}",
                        file=sys.stderr,
                    )
                    return 1
            time.sleep(0.5)
    except LaunchError as e:
        print(f"pdmesh up: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        print("pdmesh up: draining and stopping", flush=True)
        launcher.close()
    return 0


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("text", help="prompt text")
    p.add_argument(
        "--address", default=DEFAULT_ROUTER, help="router (or decode worker with --direct) host:port"
    )
    p.add_argument("--direct", action="store_true", help="talk to a decode worker directly (no router)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds")


@command("generate", _generate_args)
def generate(args: argparse.Namespace) -> int:
    """Stream a reply to TEXT from the router (or a decode worker with --direct)."""
    from pdmesh.client import stream_generate

    return stream_generate(args)


def _workers_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=DEFAULT_ROUTER, help="router host:port")
    p.add_argument("--timeout", type=float, default=5.0)


@command("workers", _workers_args)
def workers(args: argparse.Namespace) -> int:
    """List the router's workers: role, address, health, load, cached blocks."""
    from pdmesh.client import print_workers

    return print_workers(args.address, args.timeout)
