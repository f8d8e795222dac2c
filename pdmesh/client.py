"""Small synchronous helpers for talking to a pdmesh mesh (CLI, scripts, tests).

TLS: every command takes the services' `--tls-*` flags (`PDMESH_TLS_*` env;
a client certificate of role "client" for an mTLS router, a mesh role's for
workers); `--api-key` (`PDMESH_API_KEY`) is sent as `authorization: Bearer`.
"""

from __future__ import annotations

import argparse
import os

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.tls import ClientTls, TlsConfig, client_tls, sync_channel


def add_security_arguments(p: argparse.ArgumentParser, api_key: bool = True) -> None:
    """`--tls-cert-file`, ... (and `--api-key`) on a CLI subcommand."""
    from services.common.config import add_arguments

    add_arguments(p, TlsConfig, "tls_")
    if api_key:
        p.add_argument("--api-key", default=None, help="API key sent as a bearer token (env PDMESH_API_KEY)")


def tls_of(args: argparse.Namespace) -> ClientTls | None:
    from services.common.config import build

    return client_tls(build(TlsConfig, args, os.environ, "tls_"))


def auth_metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    key = getattr(args, "api_key", None) or os.environ.get("PDMESH_API_KEY", "")
    return (("authorization", f"Bearer {key}"),) if key else ()


def health_check(
    address: str, service: str = "", timeout: float = 3.0, tls: ClientTls | None = None
) -> tuple[str, str]:
    """grpc.health.v1 Check: ("SERVING" | "NOT_SERVING" | "SERVICE_UNKNOWN" | "UNREACHABLE" | ..., detail)."""
    with sync_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN", e.details() or ""
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return "UNREACHABLE", e.details() or code.name
            return code.name, e.details() or ""
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status), ""


def _sampling(args) -> common_pb2.SamplingParams:  # noqa: F821
    from pdmesh.v1 import common_pb2

    s = common_pb2.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    if args.seed is not None:
        s.seed = args.seed
    return s


def stream_generate(args) -> int:
    """CLI body of `pdmesh generate`: print text as it streams, usage at the end."""
    import sys

    from pdmesh.v1 import decode_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc

    metadata = auth_metadata(args)
    with sync_channel(args.address, tls_of(args)) as channel:
        try:
            if args.direct:
                # No router: tokenize with the built-in byte tokenizer, as the router would.
                stub = decode_pb2_grpc.DecodeServiceStub(channel)
                req = decode_pb2.DecodeServiceGenerateRequest(
                    request_id=f"cli-{id(args)}",
                    prompt_token_ids=list(args.text.encode()),
                    sampling=_sampling(args),
                )
                pending = b""
                for msg in stub.Generate(req, timeout=args.timeout):
                    if msg.HasField("tokens"):
                        pending += bytes(t for t in msg.tokens.token_ids if t < 256)
                        text = pending.decode("utf-8", errors="ignore")
                        if text:
                            sys.stdout.write(text)
                            sys.stdout.flush()
                            pending = b""
                    else:
                        u = msg.final.usage
                        print(
                            f"\n[{u.prompt_tokens} prompt + {u.completion_tokens} output tokens, "
                            f"prefill {msg.final.prefill_path} ({msg.final.disagg_reason})]"
                        )
                return 0
            stub = router_pb2_grpc.RouterServiceStub(channel)
            req = router_pb2.GenerateRequest(text=args.text, sampling=_sampling(args))
            for msg in stub.Generate(req, timeout=args.timeout, metadata=metadata):
                if msg.HasField("delta"):
                    sys.stdout.write(msg.delta.text)
                    sys.stdout.flush()
                else:
                    f, u = msg.final, msg.final.usage
                    print(
                        f"\n[{u.prompt_tokens} prompt + {u.completion_tokens} output tokens, worker "
                        f"{f.worker_id}, prefill {f.prefill_path}, migrations {f.migrations}]"
                    )
            return 0
        except grpc.RpcError as e:
            print(f"\npdmesh generate: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1


def print_workers(
    address: str, timeout: float, tls: ClientTls | None = None, metadata: tuple[tuple[str, str], ...] = ()
) -> int:
    import sys

    from pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

    with sync_channel(address, tls) as channel:
        try:
            resp = router_pb2_grpc.RouterServiceStub(channel).ListWorkers(
                router_pb2.ListWorkersRequest(), timeout=timeout, metadata=metadata
            )
        except grpc.RpcError as e:
            hint = ""
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # the public port: ListWorkers is internal
                hint = " (ListWorkers is on the router's internal port, --internal-port; pdmesh up prints it)"
            print(f"pdmesh workers: {e.code().name}: {e.details()}{hint}", file=sys.stderr)
            return 1
    rows = [("ROLE", "WORKER", "ADDRESS", "HEALTH", "RUNNING", "WAITING", "FREE BLOCKS", "CACHED", "SOURCE")]
    for w in resp.workers:
        rows.append(
            (
                common_pb2.WorkerRole.Name(w.info.role).removeprefix("WORKER_ROLE_").lower(),
                w.info.worker_id,
                w.info.address,
                router_pb2.WorkerHealth.Name(w.health).removeprefix("WORKER_HEALTH_").lower(),
                str(w.load.running),
                str(w.load.waiting),
                str(w.load.free_blocks),
                str(w.indexed_blocks),
                w.source,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0
