"""The `pdmesh` command line.

    pdmesh up                   start a local mesh on loopback and serve
    pdmesh generate TEXT        stream a reply
    pdmesh health ADDR [SVC]    grpc.health.v1 check (exit 0 only when SERVING)
    pdmesh workers              list the router's workers
    pdmesh serve ROLE           run one service in the foreground (what `up` starts)
    pdmesh certs --out DIR      a dev CA and per-role certificates for TLS/mTLS
    pdmesh keys add TENANT      a new API key (printed once; its hash goes to the keys file)

Subcommands import what they need lazily so `pdmesh health` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

Command = Callable[[argparse.Namespace], int]
_COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Command]] = {}


def command(name: str, add_args: Callable[[argparse.ArgumentParser], None]) -> Callable[[Command], Command]:
    def register(fn: Command) -> Command:
        _COMMANDS[name] = (add_args, fn)
        return fn

    return register


def _health_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", help="host:port of a pdmesh service")
    p.add_argument(
        "service", nargs="?", default="", help='service name ("" = liveness; e.g. pdmesh.v1.DecodeService)'
    )
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer")
    from pdmesh.client import add_security_arguments

    add_security_arguments(p, api_key=False)


@command("health", _health_args)
def _health(args: argparse.Namespace) -> int:
    """grpc.health.v1 check of one service (exit 0 only when SERVING)."""
    from pdmesh.client import health_check, tls_of

    status, detail = health_check(args.address, args.service, args.timeout, tls_of(args))
    print(f"{args.address} {args.service or '(liveness)'}: {status}{(' (' + detail + ')') if detail else ''}")
    return 0 if status == "SERVING" else 1


def _not_yet(name: str) -> Command:
    def run(args: argparse.Namespace) -> int:
        print(f"pdmesh {name}: the service this needs is not built yet", file=sys.stderr)
        return 2

    return run


def _load_commands() -> None:
    """Subcommands defined next to the services they drive register themselves here."""
    import importlib

    for module in ("pdmesh.commands", "pdmesh.security_commands"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise


def build_parser() -> argparse.ArgumentParser:
    _load_commands()
    parser = argparse.ArgumentParser(prog="pdmesh", description="disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("up", "generate", "workers"):
        if name not in _COMMANDS:
            _COMMANDS[name] = (lambda p: None, _not_yet(name))
    for name, (add_args, fn) in sorted(_COMMANDS.items()):
        p = sub.add_parser(name, help=(fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else None)
        add_args(p)
        p.set_defaults(func=fn)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "loadgen_args"):  # only `pdmesh bench` passes options through
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.loadgen_args = [*extra, *args.loadgen_args]
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # Run the importable module, not this __main__ copy: subcommand modules
    # register themselves into `pdmesh.cli`.
    from pdmesh import cli

    sys.exit(cli.main())
