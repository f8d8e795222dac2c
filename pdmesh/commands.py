"""`pdmesh up`, `pdmesh generate`, `pdmesh workers`: the local mesh and its clients."""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import time

from pdmesh.cli import command
from pdmesh.client import add_security_arguments
from pdmesh.launcher import Launcher, LaunchError, RunningService, ServiceSpec, flags, wait_all
from services.model.catalog import (
    DEFAULT_MODEL,
    ModelChoice,
    ModelNotFoundError,
    cpu_default_dtype,
    resolve_model,
)

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
    p.add_argument(
        "--model",
        default=None,
        help=f"model to serve: {DEFAULT_MODEL} (default; env PDMESH_MODEL), builtin-tiny, builtin-small "
        "(random weights, for tests), or a Hugging Face folder / .gguf file",
    )
    p.add_argument(
        "--preset", default=None, help="built-in preset (tiny, small): same as --model builtin-<preset>"
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="engine dtype (float32, bfloat16); default: bfloat16 where the CPU has native bf16, else float32",
    )
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


def model_choice(args: argparse.Namespace) -> ModelChoice:
    """What `--model` / `--preset` / PDMESH_MODEL name (services.model.catalog)."""
    if args.model:
        return resolve_model(args.model)
    if args.preset:
        return resolve_model(f"builtin-{args.preset}")
    return resolve_model(os.environ.get("PDMESH_MODEL") or DEFAULT_MODEL)


def mesh_specs(args: argparse.Namespace) -> list[ServiceSpec]:
    """The topology `pdmesh up` starts, in start order (kvtransfer address filled in later)."""
    model = model_choice(args)
    engine = flags(
        engine_model_path=model.model_path,
        engine_preset=model.preset,
        engine_model_id=model.model_id,
        engine_dtype=args.dtype or cpu_default_dtype(),
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


class StartStatus:
    """Which services are up, shown while `pdmesh up` starts them: one line
    rewritten in place on a terminal, a line per service otherwise."""

    def __init__(self, names: list[str], out=sys.stdout):
        self.state = dict.fromkeys(names, "...")
        self.out = out
        self.tty = out.isatty()

    def ready(self, svc: RunningService, shown: str | None = None) -> None:
        self.state[svc.spec.name] = "ok"
        if self.tty:
            line = "  ".join(f"{n} {'✓' if s == 'ok' else '…'}" for n, s in self.state.items())
            self.out.write(f"\r\033[K  {line}")
        else:
            self.out.write(f"  {svc.spec.name:<12} {shown or svc.address}  SERVING\n")
        self.out.flush()

    def done(self, started: dict[str, RunningService]) -> None:
        if self.tty:
            self.out.write("\n")
            for name, svc in started.items():
                self.out.write(f"  {name:<12} {svc.address}  SERVING\n")
        self.out.flush()


def start_mesh(
    launcher: Launcher, args: argparse.Namespace, status: StartStatus | None = None
) -> dict[str, RunningService]:
    """Start kvtransfer, the prefill workers, the decode workers (each group in
    parallel), then the router and the gateway; wait for each to be SERVING."""
    specs = mesh_specs(args)
    names = [s.name for s in specs] + ["router", "gateway"]
    status = status or StartStatus(names)
    started: dict[str, RunningService] = {}

    def group(svcs: list[RunningService]) -> list[RunningService]:
        wait_all(launcher, svcs, args.timeout, on_ready=status.ready)
        started.update({s.spec.name: s for s in svcs})
        return svcs

    (kv,) = group([launcher.start(specs[0])])
    prefills = group(
        [
            launcher.start(_with(s, kvtransfer_address=kv.address))
            for s in specs
            if s.name.startswith("prefill")
        ]
    )
    prefill_addrs = [s.address for s in prefills]
    decodes = group(
        [
            launcher.start(_with(s, kvtransfer_address=kv.address, prefill_workers=prefill_addrs or None))
            for s in specs
            if s.name.startswith("decode")
        ]
    )
    router_flags = flags(
        host=args.host,
        port=args.router_port,
        decode_workers=[d.address for d in decodes],
        prefill_workers=prefill_addrs or None,
        policy=args.policy,
        preset=model_choice(args).preset,
        model_path=model_choice(args).model_path,
        model_id=model_choice(args).model_id,
    )
    (router,) = group(
        [
            launcher.start(
                ServiceSpec(
                    "router",
                    SERVICES["router"][0],
                    router_flags,
                    ready_service=SERVICES["router"][1],
                    host=args.host,
                )
            )
        ]
    )
    if _exists("services.gateway.main"):
        from services.gateway.launch import gateway_spec, start_ready

        gateway = start_ready(
            launcher,
            gateway_spec(
                router.address,
                host=args.host,
                port=args.gateway_port,
                model_path=model_choice(args).model_path,
                preset=model_choice(args).preset,
                extra=flags(served_model_name=model_choice(args).model_id),
            ),
            args.timeout,
        )
        started["gateway"] = gateway
        status.ready(gateway, f"http://{gateway.address}/v1")
    status.done(started)
    return started


def _with(spec: ServiceSpec, **extra: object) -> ServiceSpec:
    return ServiceSpec(
        spec.name, spec.module, spec.args + flags(**extra), spec.env, spec.ready_service, spec.host
    )


@command("up", _up_args)
def up(args: argparse.Namespace) -> int:
    """Start a local mesh (kvtransfer, prefill, decode, router) and serve until Ctrl-C."""
    try:
        print(f"pdmesh up: model {model_choice(args).model_id}", flush=True)
    except ModelNotFoundError as e:
        print(f"pdmesh up: {e}", file=sys.stderr)
        return 2
    launcher = Launcher(args.workdir)
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    print(f"pdmesh up: starting (logs in {launcher.workdir})", flush=True)
    try:
        started = start_mesh(launcher, args)
        router = started["router"]
        print(
            f"pdmesh up: serving on {router.address} (router); try: pdmesh generate --address {router.address} "
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
    add_security_arguments(p)


@command("generate", _generate_args)
def generate(args: argparse.Namespace) -> int:
    """Stream a reply to TEXT from the router (or a decode worker with --direct)."""
    from pdmesh.client import stream_generate

    return stream_generate(args)


def _workers_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=DEFAULT_ROUTER, help="router host:port")
    p.add_argument("--timeout", type=float, default=5.0)
    add_security_arguments(p)


@command("workers", _workers_args)
def workers(args: argparse.Namespace) -> int:
    """List the router's workers: role, address, health, load, cached blocks."""
    from pdmesh.client import auth_metadata, print_workers, tls_of

    return print_workers(args.address, args.timeout, tls_of(args), auth_metadata(args))


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "loadgen_args", nargs=argparse.REMAINDER, help="arguments of bench/loadgen.py (see --help)"
    )


@command("bench", _bench_args)
def bench(args: argparse.Namespace) -> int:
    """Run the load generator (bench/loadgen.py) against a router or an OpenAI-compatible endpoint."""
    try:
        from bench import loadgen
    except ModuleNotFoundError:
        print("pdmesh bench: run it from a pdmesh checkout (bench/ is not installed)", file=sys.stderr)
        return 2
    return loadgen.main(args.loadgen_args or ["--help"])
