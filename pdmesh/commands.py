"""`pdmesh up`, `pdmesh generate`, `pdmesh workers`: the local mesh and its clients."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pdmesh.cli import command
from pdmesh.client import add_security_arguments
from pdmesh.launcher import Launcher, LaunchError, RunningService, ServiceSpec, flags, wait_all
from pdmesh.local_planner import LocalPlanner, add_planner_arguments, check_planner_args
from pdmesh.mesh_tls import MeshTls, MissingCertificates
from services.common.tls import client_tls
from services.model.catalog import (
    DEFAULT_MODEL,
    ModelChoice,
    ModelNotFoundError,
    cpu_default_dtype,
    resolve_model,
)

DEFAULT_ROUTER = "127.0.0.1:50051"
DEFAULT_ROUTER_INTERNAL = "127.0.0.1:50061"  # compose's and Kubernetes' --internal-port
SERVICES = {
    "kvtransfer": ("services.kvtransfer.main", "pdmesh.v1.KvTransferService"),
    "prefill": ("services.prefill.main", "pdmesh.v1.PrefillService"),
    "decode": ("services.decode.main", "pdmesh.v1.DecodeService"),
    "router": ("services.router.main", "pdmesh.v1.RouterService"),
}


def _up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--host", default="127.0.0.1", help="address every service listens on")
    p.add_argument(
        "--router-port", type=int, default=50051, help="the router's public port (0 = any free port)"
    )
    p.add_argument(
        "--http-port",
        "--gateway-port",  # its name while the HTTP API was a process of its own
        dest="http_port",
        type=int,
        default=8000,
        help="the router's OpenAI-compatible HTTP port (0 = any free port)",
    )
    p.add_argument(
        "--routers",
        type=int,
        default=1,
        help="router processes sharing the gRPC and HTTP ports (SO_REUSEPORT), each with its own worker view",
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
    p.add_argument(
        "--router-internal-port",
        type=int,
        default=0,
        help="the router's internal port: worker membership, ListWorkers, Stats (0 = any free port)",
    )
    p.add_argument(
        "--tls-dir",
        default=None,
        help="mTLS everywhere, each service with its own certificate from "
        "`pdmesh certs --out DIR --worker decode/decode-0 --worker prefill/prefill-0 ...`",
    )
    p.add_argument(
        "--api-keys-file", default=None, help="tenant API keys the router requires (`pdmesh keys add`)"
    )
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for each service")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="Prometheus ports: service i gets BASE+i (0 = each a free port, -1 = off); printed at start",
    )
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="KV pool size in blocks per worker (default: the engine's)",
    )
    p.add_argument(
        "--restart",
        action="store_true",
        help="restart a prefill/decode worker that exits (on its port); without it the mesh stays up without it",
    )
    add_planner_arguments(p)


def _tls(args: argparse.Namespace) -> MeshTls | None:
    tls_dir = getattr(args, "tls_dir", None)
    return MeshTls(Path(tls_dir)) if tls_dir else None


def _own_cert(args: argparse.Namespace, role: str, worker: str = "") -> tuple[str, ...]:
    """A service's own certificate flags with --tls-dir (none without)."""
    tls = _tls(args)
    return tls.flags(role, worker) if tls is not None else ()


def check_certificates(args: argparse.Namespace) -> None:
    """With --tls-dir: every certificate the topology needs is there (MissingCertificates)."""
    tls = _tls(args)
    if tls is not None:
        workers = [("prefill", f"prefill-{i}") for i in range(args.prefill)]
        workers += [("decode", f"decode-{i}") for i in range(args.decode)]
        tls.check([("kvtransfer", ""), ("router", ""), *workers])


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
        engine_num_blocks=getattr(args, "kv_blocks", None),
    )
    specs = [
        ServiceSpec(
            "kvtransfer",
            SERVICES["kvtransfer"][0],
            flags(host=args.host) + _own_cert(args, "kvtransfer"),
            ready_service=SERVICES["kvtransfer"][1],
            host=args.host,
        )
    ]
    for i in range(args.prefill):
        specs.append(
            ServiceSpec(
                f"prefill-{i}",
                SERVICES["prefill"][0],
                flags(host=args.host, worker_id=f"prefill-{i}", kv_transport=args.kv_transport)
                + engine
                + _own_cert(args, "prefill", f"prefill-{i}"),
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
                + engine
                + _own_cert(args, "decode", f"decode-{i}"),
                ready_service=SERVICES["decode"][1],
                host=args.host,
            )
        )
    return _metrics_flags(specs, getattr(args, "metrics_port", -1))


def _metrics(svc: RunningService) -> str:
    return f"  metrics :{svc.metrics_port}" if svc.metrics_port else ""


class StartStatus:
    """Which services are up, shown while `pdmesh up` starts them: one line
    rewritten in place on a terminal, a line per service otherwise."""

    def __init__(self, names: list[str], out=sys.stdout):
        self.state = dict.fromkeys(names, "...")
        self.out = out
        self.tty = out.isatty()
        self.extra: list[str] = []

    def ready(self, svc: RunningService, shown: str | None = None) -> None:
        self.state[svc.spec.name] = "ok"
        if self.tty:
            line = "  ".join(f"{n} {'✓' if s == 'ok' else '…'}" for n, s in self.state.items())
            self.out.write(f"\r\033[K  {line}")
        else:
            self.out.write(f"  {svc.spec.name:<12} {shown or svc.address}  SERVING{_metrics(svc)}\n")
        self.out.flush()

    def line(self, name: str, shown: str) -> None:
        """A line that is not a service (the HTTP API's address)."""
        if not self.tty:
            self.out.write(f"  {name:<12} {shown}\n")
            self.out.flush()
        else:
            self.extra.append(f"  {name:<12} {shown}\n")

    def done(self, started: dict[str, RunningService]) -> None:
        if self.tty:
            self.out.write("\n")
            for name, svc in started.items():
                self.out.write(f"  {name:<12} {svc.address}  SERVING{_metrics(svc)}\n")
            self.out.writelines(self.extra)
        self.out.flush()


def start_mesh(
    launcher: Launcher, args: argparse.Namespace, status: StartStatus | None = None
) -> dict[str, RunningService]:
    """Start kvtransfer, the prefill workers, the decode workers (each group in
    parallel), then the router or routers (each serving gRPC and the OpenAI HTTP
    API); wait for each to be SERVING."""
    specs = mesh_specs(args)
    routers = max(1, getattr(args, "routers", 1))
    router_names = ["router"] + [f"router-{i}" for i in range(1, routers)]
    names = [s.name for s in specs] + router_names
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
    common = flags(
        host=args.host,
        decode_workers=[d.address for d in decodes],
        prefill_workers=prefill_addrs or None,
        policy=args.policy,
        preset=model_choice(args).preset,
        model_path=model_choice(args).model_path,
        model_id=model_choice(args).model_id,
        api_keys_file=getattr(args, "api_keys_file", None),
        # Several routers: each binds the same ports with SO_REUSEPORT and the kernel spreads
        # the connections; each probes the workers itself (its own view, its own links).
        so_reuseport=1 if routers > 1 else None,
    ) + _own_cert(args, "router")
    base = getattr(args, "metrics_port", -1)

    def router_spec(i: int, port: int, http_port: int, internal_port: int) -> ServiceSpec:
        extra = flags(port=port, http_port=http_port, internal_port=internal_port)
        if base >= 0:
            extra += flags(metrics_port=base + len(specs) + i if base else 0)
        return ServiceSpec(
            router_names[i],
            SERVICES["router"][0],
            common + extra,
            ready_service=SERVICES["router"][1],
            host=args.host,
        )

    # The first router takes the ports (0 = free ones); the others join it on the same ports.
    (first,) = group(
        [
            launcher.start(
                router_spec(
                    0,
                    args.router_port,
                    getattr(args, "http_port", -1),
                    getattr(args, "router_internal_port", 0),
                )
            )
        ]
    )
    group([launcher.start(router_spec(i, first.port, first.http_port or 0, 0)) for i in range(1, routers)])
    tls = _tls(args)
    http = f"{'https' if tls else 'http'}://{args.host}:{first.http_port}/v1"
    status.line("http", f"{http}  (the router's OpenAI-compatible API)")
    status.done(started)
    return started


def _metrics_flags(specs: list[ServiceSpec], base: int) -> list[ServiceSpec]:
    """Service i gets metrics port base+i (base 0: a free port each; -1: none)."""
    if base < 0:
        return specs
    return [_with(s, metrics_port=base + i if base else 0) for i, s in enumerate(specs)]


def ports_in_use(host: str, ports: list[int]) -> list[int]:
    """The fixed ports (0 = any, skipped) that something already listens on."""
    busy = []
    for port in ports:
        if port <= 0:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                busy.append(port)
    return busy


def _with(spec: ServiceSpec, **extra: object) -> ServiceSpec:
    return ServiceSpec(
        spec.name, spec.module, spec.args + flags(**extra), spec.env, spec.ready_service, spec.host
    )


# Children that may come back (--restart) or be missed; the others carry the mesh.
_WORKER_PREFIXES = ("prefill-", "decode-")


@command("up", _up_args)
def up(args: argparse.Namespace) -> int:
    """Start a local mesh (kvtransfer, prefill, decode, router with its HTTP API) and serve until Ctrl-C."""
    try:
        print(f"pdmesh up: model {model_choice(args).model_id}", flush=True)
    except ModelNotFoundError as e:
        print(f"pdmesh up: {e}", file=sys.stderr)
        return 2
    busy = ports_in_use(args.host, [args.router_port, args.http_port])
    if busy:  # before anything starts: the README's message, not a traceback after 12 s
        print(
            f"pdmesh up: port {', '.join(map(str, busy))} on {args.host} is already in use (another mesh "
            "running?); stop it, or pick free ports: pdmesh up --router-port 0 --http-port 0",
            file=sys.stderr,
        )
        return 1
    if problem := check_planner_args(args):
        print(f"pdmesh up: {problem}", file=sys.stderr)
        return 2
    tls = _tls(args)
    try:
        check_certificates(args)
    except MissingCertificates as e:
        print(f"pdmesh up: {e}", file=sys.stderr)
        return 2
    # Readiness checks of a TLS mesh present the router's certificate (any mesh role may ask health).
    launcher = Launcher(args.workdir, tls=tls.config("router") if tls is not None else None)
    stop = {"now": False}

    def on_signal(signum, frame):
        # Installed explicitly for SIGINT too: a shell's background job inherits SIGINT as
        # ignored, and Python then installs no KeyboardInterrupt handler of its own.
        first = not stop["now"]
        stop["now"] = True
        if first and not started_ok["yes"]:
            raise KeyboardInterrupt  # abort the start-up waits

    started_ok = {"yes": False}
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"pdmesh up: starting (logs in {launcher.workdir})", flush=True)
    planner: LocalPlanner | None = None
    try:
        started = start_mesh(launcher, args)
        started_ok["yes"] = True
        router = started["router"]
        print(
            f"pdmesh up: serving on {router.address} (router); try: pdmesh generate --address {router.address} "
            f'"Hello"   (Ctrl-C to stop)',
            flush=True,
        )
        print(f"pdmesh up: workers and operators (pdmesh workers) use {router.internal_address}", flush=True)
        if args.planner:
            planner = LocalPlanner(
                launcher,
                args,
                started,
                tls=client_tls(tls.config("router")) if tls is not None else None,
                cert_flags=lambda role, name: _own_cert(args, role, name),
            )
            planner.start()
            print(
                f"pdmesh up: planner on; its decisions: pdmesh workers --planner-state {planner.state_file}",
                flush=True,
            )
        return _supervise(launcher, args, stop, planner.owns if planner is not None else None)
    except LaunchError as e:
        print(f"pdmesh up: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        print("pdmesh up: draining and stopping", flush=True)
        started_ok["yes"] = True  # from here a SIGTERM only flags: it must not interrupt the stop
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the drain short
        if planner is not None:  # no scaling while the mesh stops; its drains in progress finish
            planner.stop()
        launcher.close()
    return 0


def _interrupted(stop: dict[str, bool]) -> None:
    if stop["now"]:  # a signal while a restarted worker starts: stop waiting for it
        raise KeyboardInterrupt


def _supervise(
    launcher: Launcher,
    args: argparse.Namespace,
    stop: dict[str, bool],
    planned: Callable[[RunningService], bool] | None = None,
) -> int:
    """Watch the children until a signal. A worker that exits (drained or crashed) is
    reported and, with --restart, started again on its port; the mesh stays up. The
    router (any of them) or kvtransfer exiting stops the mesh: nothing is served without them."""
    gone: set[int] = set()
    while not stop["now"]:
        for svc in list(launcher.services):
            code = svc.proc.poll()
            if code is None or id(svc) in gone or (planned is not None and planned(svc)):
                continue  # running, seen, or the planner is draining it
            if not svc.spec.name.startswith(_WORKER_PREFIXES):
                print(
                    f"pdmesh up: {svc.spec.name} exited ({code}); stopping\n{svc.log_tail()}", file=sys.stderr
                )
                return 1
            gone.add(id(svc))
            how = "drained and exited" if code == 0 else f"crashed (exit {code})"
            print(f"pdmesh up: {svc.spec.name} {how}; log: {svc.log_path}", file=sys.stderr, flush=True)
            if args.restart:
                spec = dataclasses.replace(svc.spec, args=svc.spec.args + flags(port=svc.port))
                at = launcher.services.index(svc)
                launcher.services.remove(svc)
                new = launcher.start(spec)
                # Its old place, so that close() still stops the workers after the router.
                launcher.services.insert(at, launcher.services.pop())
                print(f"pdmesh up: restarting {spec.name} on {svc.address}", flush=True)
                try:
                    launcher.wait_ready(new, args.timeout, on_poll=lambda: _interrupted(stop))
                    print(f"pdmesh up: {spec.name} is back", flush=True)
                except LaunchError as e:
                    print(f"pdmesh up: {spec.name} did not come back: {e}", file=sys.stderr, flush=True)
        time.sleep(0.5)  # a supervisor's poll interval, not synchronisation
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
    p.add_argument(
        "--address", default=DEFAULT_ROUTER, help="the router's internal host:port (--internal-port)"
    )
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument(
        "--planner-state",
        default=None,
        help="also show the planner's last decision and why (the file `pdmesh up --planner` prints)",
    )
    add_security_arguments(p)


@command("workers", _workers_args)
def workers(args: argparse.Namespace) -> int:
    """List the router's workers: role, address, health, load, cached blocks (and the planner's decision)."""
    from pdmesh.client import auth_metadata, print_workers, tls_of
    from pdmesh.local_planner import print_planner_state

    code = print_workers(args.address, args.timeout, tls_of(args), auth_metadata(args))
    if args.planner_state:
        code = print_planner_state(args.planner_state) or code
    return code


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
