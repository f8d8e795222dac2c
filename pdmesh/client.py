"""Small synchronous helpers for talking to a pdmesh mesh (CLI, scripts, tests)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def health_check(address: str, service: str = "", timeout: float = 3.0) -> tuple[str, str]:
    """grpc.health.v1 Check: ("SERVING" | "NOT_SERVING" | "SERVICE_UNKNOWN" | "UNREACHABLE" | ..., detail)."""
    with grpc.insecure_channel(address) as channel:
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

    with grpc.insecure_channel(args.address) as channel:
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
            for msg in stub.Generate(req, timeout=args.timeout):
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


def print_workers(address: str, timeout: float) -> int:
    import sys

    from pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            resp = router_pb2_grpc.RouterServiceStub(channel).ListWorkers(
                router_pb2.ListWorkersRequest(), timeout=timeout
            )
        except grpc.RpcError as e:
            print(f"pdmesh workers: {e.code().name}: {e.details()}", file=sys.stderr)
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
