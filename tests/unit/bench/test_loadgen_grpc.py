"""bench.loadgen gRPC clients against in-process fake servicers on port 0."""

import asyncio

import grpc
import pytest

from bench import loadgen
from bench.loadgen import WorkItem, run_load
from bench.stats import read_run
from pdmesh.v1 import common_pb2, decode_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc

# The fake's behaviour is chosen by the first prompt token.
OK, ABORT, NO_FINAL, HANG = 1, 2, 3, 4


class FakeRouter(router_pb2_grpc.RouterServiceServicer):
    def __init__(self):
        self.requests: list[router_pb2.GenerateRequest] = []

    async def Generate(self, request, context):
        self.requests.append(request)
        mode = request.token_ids.ids[0]
        if mode == HANG:
            await asyncio.Event().wait()  # until the client's deadline cancels the RPC
        for ids in ([10, 11], [12], [13, 14, 15]):
            yield router_pb2.GenerateResponse(delta=router_pb2.TokenDelta(token_ids=ids, text="x"))
            if mode == ABORT:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "shed")
        if mode == NO_FINAL:
            return
        usage = common_pb2.Usage(prompt_tokens=3, completion_tokens=6, cached_prompt_tokens=2)
        final = router_pb2.GenerateFinal(
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=usage,
            request_id=request.request_id,
            worker_id="decode-1",
            prefill_path="remote",
        )
        yield router_pb2.GenerateResponse(final=final)


class FakeDecode(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self):
        self.requests: list[decode_pb2.DecodeServiceGenerateRequest] = []

    async def Generate(self, request, context):
        self.requests.append(request)
        for ids in ([7, 8, 9], [10]):
            yield decode_pb2.DecodeServiceGenerateResponse(tokens=decode_pb2.TokenIdsDelta(token_ids=ids))
        final = decode_pb2.DecodeFinal(
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=common_pb2.Usage(prompt_tokens=2, completion_tokens=4),
            prefill_path="local",
        )
        yield decode_pb2.DecodeServiceGenerateResponse(final=final)


@pytest.fixture
async def server():
    srv = grpc.aio.server()
    router, decode = FakeRouter(), FakeDecode()
    router_pb2_grpc.add_RouterServiceServicer_to_server(router, srv)
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(decode, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    yield f"grpc://127.0.0.1:{port}", router, decode
    await srv.stop(None)


async def test_router_client_records_tokens_usage_and_errors(server):
    target, router, _ = server
    items = [WorkItem(0.0, (mode, 5, 6), 6) for mode in (OK, ABORT, NO_FINAL)]
    ok, aborted, truncated = await run_load(items, target, max_requests=3, max_duration_s=10, timeout_s=10)

    assert ok.ok and ok.error_code == ""
    assert ok.token_counts == [2, 1, 3] and ok.output_tokens == 6
    assert (ok.prompt_tokens, ok.cached_tokens) == (3, 2)
    assert (ok.worker_id, ok.prefill_path, ok.finish_reason) == ("decode-1", "remote", "FINISH_REASON_LENGTH")
    assert ok.send_s <= ok.token_times_s[0] <= ok.token_times_s[-1] <= ok.end_s

    assert not aborted.ok and aborted.error_code == "RESOURCE_EXHAUSTED" and aborted.error_detail == "shed"
    assert aborted.token_counts == [2]  # what arrived before the abort is kept
    assert not truncated.ok and truncated.error_code == "INCOMPLETE_STREAM"

    sent = {r.request_id: r for r in router.requests}
    req = sent[ok.request_id]
    assert list(req.token_ids.ids) == [OK, 5, 6]
    assert req.sampling.max_tokens == 6 and req.sampling.ignore_eos


async def test_router_client_deadline(server):
    target, _, _ = server
    (rec,) = await run_load(
        [WorkItem(0.0, (HANG,), 2)], target, max_requests=1, max_duration_s=1, timeout_s=0.2
    )
    assert not rec.ok and rec.error_code == "DEADLINE_EXCEEDED" and rec.token_counts == []


async def test_unreachable_target_is_recorded_as_unavailable():
    srv = grpc.aio.server()
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    await srv.stop(None)  # the port is now closed
    (rec,) = await run_load(
        [WorkItem(0.0, (OK,), 2)], f"grpc://127.0.0.1:{port}", max_requests=1, max_duration_s=1, timeout_s=5
    )
    assert not rec.ok and rec.error_code == "UNAVAILABLE"


async def test_decode_client_calls_the_worker_directly(server):
    target, router, decode = server
    (rec,) = await run_load(
        [WorkItem(0.0, (1, 2), 4)],
        target,
        max_requests=1,
        max_duration_s=1,
        timeout_s=5,
        grpc_service="decode",
    )
    assert rec.ok and rec.token_counts == [3, 1] and rec.output_tokens == 4 and rec.prefill_path == "local"
    assert router.requests == []
    (req,) = decode.requests
    assert req.request_id == rec.request_id and list(req.prompt_token_ids) == [1, 2]
    assert req.sampling.ignore_eos and req.sampling.max_tokens == 4 and not req.prefill_candidates


async def test_cli_end_to_end(server, tmp_path, capsys):
    target, router, _ = server
    out = tmp_path / "run.jsonl"
    argv = [
        "--target", target, "--trace", "poisson", "--rate", "1000", "--num-requests", "5",
        "--max-duration-s", "60", "--length-scale", "4", "--time-scale", "0.5", "--input-len", "20",
        "--output-len", "6", "--slo-ttft-ms", "10000", "--slo-tpot-ms", "10000", "--out", str(out),
        "--special-ids", f"{ABORT},{NO_FINAL},{HANG}",  # random prompts must not trigger a fault
    ]  # fmt: skip
    # main() runs its own event loop; the fake server lives on this one.
    assert await asyncio.to_thread(loadgen.main, argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert all("length_factor=4 time_factor=0.5" in line for line in lines)
    last = dict(kv.split("=", 1) for kv in lines[-1].split()[1:])
    assert lines[-1].startswith("loadgen ")
    assert (last["ok"], last["errors"], last["slo_attainment"]) == ("5", "0", "1.000")
    meta, records = read_run(out)
    assert meta["length_factor"] == 4 and len(records) == 5
    assert all(len(r.token_ids.ids) == 5 for r in router.requests)  # ceil(20 / 4) tokens
    assert all(r.sampling.max_tokens == 2 for r in router.requests)  # ceil(6 / 4)
