"""Open-loop load generator for pdmesh and OpenAI-compatible servers.

Owns the arrival process (Poisson or trace timestamps, always bounded by a
request count and a duration), the streaming clients that time every token
message into a ``bench.stats.RequestRecord``, and the CLI that writes the
records as JSONL and prints ``bench.stats`` summaries. Clients:

- ``GrpcClient``: ``pdmesh.v1.RouterService/Generate`` (the public API), or
  ``pdmesh.v1.DecodeService/Generate`` on one decode worker, bypassing the
  router, to measure the router hop.
- ``OpenAIHttpClient``: ``POST /v1/completions`` with ``stream: true`` (SSE),
  written on asyncio streams + h11 (no new dependency; h11 is installed here
  through tokenizers -> huggingface_hub -> httpx2 -> httpcore2).

Open loop: a request is sent at its arrival time whether or not earlier ones
have finished, so an overloaded server shows up as latency, not as a lower
offered rate. Library use: ``build_workload`` then ``await run_load(...)``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

if __package__ in (None, ""):  # `python bench/loadgen.py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc
import h11
import numpy as np

from bench.stats import RequestRecord, format_summary, summarize, summary_kv, write_records
from bench.traces import PromptSynthesizer, TraceRequest, VocabRange, default_trace_path, load_trace, scale
from pdmesh.v1 import common_pb2, decode_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc

# Hard caps: a run must name both bounds, and neither may exceed these.
MAX_REQUESTS_CAP = 1_000_000
MAX_DURATION_CAP_S = 24 * 3600.0

Clock = Callable[[], float]


@dataclass(frozen=True)
class WorkItem:
    """One request to send: when (seconds after the run starts) and what."""

    arrival_s: float
    prompt_ids: tuple[int, ...]
    max_tokens: int


def check_bounds(max_requests: int, max_duration_s: float, timeout_s: float) -> None:
    """Refuse a run that is not bounded in count, duration and per-request time."""
    if not isinstance(max_requests, int) or not 1 <= max_requests <= MAX_REQUESTS_CAP:
        raise ValueError(f"max_requests must be in [1, {MAX_REQUESTS_CAP}], got {max_requests!r}")
    if not 0 < max_duration_s <= MAX_DURATION_CAP_S:
        raise ValueError(f"max_duration_s must be in (0, {MAX_DURATION_CAP_S}], got {max_duration_s!r}")
    if not 0 < timeout_s <= MAX_DURATION_CAP_S:
        raise ValueError(f"timeout_s must be in (0, {MAX_DURATION_CAP_S}], got {timeout_s!r}")


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """``n`` arrival times of a Poisson process at ``rate``/s, the first at 0."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a finite number > 0, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=max(n - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


def build_workload(
    trace: str,
    *,
    num_requests: int,
    max_duration_s: float,
    length_factor: float = 1.0,
    time_factor: float = 1.0,
    rate: float | None = None,
    seed: int = 0,
    vocab: VocabRange = VocabRange(),
    input_len: int = 128,
    output_len: int = 32,
    trace_path: str | Path | None = None,
) -> list[WorkItem]:
    """Requests of a "mooncake" / "azure" trace or a "poisson" process, scaled
    (``bench.traces.scale``: lengths / length_factor, inter-arrivals x
    time_factor) and bounded, with synthesised prompts."""
    if trace == "poisson":
        if rate is None:
            raise ValueError("poisson arrivals need a rate")
        reqs = [TraceRequest(t, input_len, output_len) for t in poisson_arrivals(rate, num_requests, seed)]
    else:
        if rate is not None:
            raise ValueError("a trace brings its own arrival times; change them with time_factor")
        reqs = load_trace(trace, trace_path or default_trace_path(trace))
    reqs = scale(reqs, length_factor, time_factor, num_requests, max_duration_s)
    synth = PromptSynthesizer(vocab, length_factor, seed)
    return [WorkItem(r.arrival_s, tuple(synth.prompt(r, i)), r.output_len) for i, r in enumerate(reqs)]


class StreamClient(Protocol):
    """Sends one request and fills its record: ``send_s`` right before sending,
    one ``add_message`` per token message, then ok/error and ``end_s``."""

    async def generate(self, rec: RequestRecord, item: WorkItem, clock: Clock, timeout_s: float) -> None: ...

    async def close(self) -> None: ...


class GrpcClient:
    """``RouterService.Generate`` (service "router": the public API) or
    ``DecodeService.Generate`` on one decode worker (service "decode": local
    prefill, no router hop). Token-id prompt, greedy, EOS ignored so the output
    length is the trace's; the gRPC deadline is ``timeout_s``."""

    def __init__(self, address: str, service: str = "router"):
        if service not in ("router", "decode"):
            raise ValueError(f"grpc_service must be router or decode, got {service!r}")
        self.address, self.service = address, service
        self._channel = grpc.aio.insecure_channel(address)
        self._router = router_pb2_grpc.RouterServiceStub(self._channel)
        self._decode = decode_pb2_grpc.DecodeServiceStub(self._channel)

    def _call(self, rec: RequestRecord, item: WorkItem, timeout_s: float):
        sampling = common_pb2.SamplingParams(max_tokens=item.max_tokens, ignore_eos=True)
        if self.service == "decode":
            req = decode_pb2.DecodeServiceGenerateRequest(
                request_id=rec.request_id, prompt_token_ids=item.prompt_ids, sampling=sampling
            )
            return self._decode.Generate(req, timeout=timeout_s)
        ids = common_pb2.TokenIds(ids=item.prompt_ids)
        req = router_pb2.GenerateRequest(request_id=rec.request_id, token_ids=ids, sampling=sampling)
        return self._router.Generate(req, timeout=timeout_s)

    async def generate(self, rec: RequestRecord, item: WorkItem, clock: Clock, timeout_s: float) -> None:
        rec.send_s = clock()
        final = None
        try:
            async for resp in self._call(rec, item, timeout_s):
                kind = resp.WhichOneof("chunk")  # router: delta | final; decode: tokens | final
                if kind == "final":
                    final = resp.final
                elif ids := getattr(resp, kind).token_ids:
                    rec.add_message(clock(), len(ids))
        except grpc.aio.AioRpcError as e:
            rec.error_code, rec.error_detail = e.code().name, e.details() or ""
        finally:
            rec.end_s = clock()
        if rec.error_code:
            return
        if final is None or not rec.token_times_s:
            rec.error_code = "INCOMPLETE_STREAM"
            rec.error_detail = "stream ended without a final message" if final is None else "no tokens"
            return
        rec.ok = True
        rec.finish_reason = common_pb2.FinishReason.Name(final.finish_reason)
        rec.prefill_path = final.prefill_path
        rec.worker_id = final.worker_id if self.service == "router" else self.address
        if final.HasField("usage"):
            rec.output_tokens = final.usage.completion_tokens
            rec.prompt_tokens = final.usage.prompt_tokens or rec.prompt_tokens
            rec.cached_tokens = final.usage.cached_prompt_tokens

    async def close(self) -> None:
        await self._channel.close()


class SseParser:
    """Incremental text/event-stream parser: bytes in, ``data`` payloads out."""

    def __init__(self) -> None:
        self._buf = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        # errors="replace": a split UTF-8 character must not kill the stream; JSON
        # payloads escape non-ASCII anyway.
        self._buf += chunk.decode("utf-8", errors="replace")
        out = []
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            line = line.removesuffix("\r")
            if not line:  # a blank line ends an event
                if self._data:
                    out.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[5:].removeprefix(" "))
            # Comments (":" pings) and event:/id:/retry: fields carry no tokens.
        return out


class OpenAIHttpClient:
    """``POST {base}/v1/completions`` streaming, one HTTP/1.1 connection per
    request (no pool: connection setup counts in TTFT, ~0.1 ms on loopback).

    Token counts per chunk come from ``usage.completion_tokens`` deltas when the
    server sends continuous usage (vLLM's ``continuous_usage_stats``); otherwise
    every chunk with choices counts as one token, as vLLM's bench does, and the
    final usage (if any) sets ``output_tokens`` for TPOT and throughput.
    """

    def __init__(self, base_url: str, model: str = ""):
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"want http://HOST:PORT[/prefix], got {base_url!r}")
        self.host, self.port = u.hostname, u.port or 80
        path = u.path.rstrip("/")
        self.path = path if path.endswith("/completions") else path + "/v1/completions"
        self.model = model

    def _body(self, item: WorkItem) -> bytes:
        body = {
            "prompt": list(item.prompt_ids),
            "max_tokens": item.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if self.model:
            body["model"] = self.model
        return json.dumps(body).encode()

    async def generate(self, rec: RequestRecord, item: WorkItem, clock: Clock, timeout_s: float) -> None:
        rec.send_s = clock()
        try:
            async with asyncio.timeout(timeout_s):
                await self._exchange(rec, item, clock)
        except TimeoutError:
            rec.error_code, rec.error_detail = "DEADLINE_EXCEEDED", f"no end within {timeout_s}s"
        except OSError as e:
            rec.error_code, rec.error_detail = "UNAVAILABLE", str(e)
        except (h11.ProtocolError, json.JSONDecodeError, UnicodeDecodeError) as e:
            rec.error_code, rec.error_detail = "PROTOCOL_ERROR", str(e)
        finally:
            rec.end_s = clock()
        rec.ok = not rec.error_code

    def _request(self, conn: h11.Connection, item: WorkItem) -> bytes:
        """The whole request on `conn`, as bytes: head, JSON body, end."""
        body = self._body(item)
        headers = [
            ("Host", f"{self.host}:{self.port}"),
            ("Content-Type", "application/json"),
            ("Accept", "text/event-stream"),
            ("Content-Length", str(len(body))),
            ("Connection", "close"),
        ]
        head = conn.send(h11.Request(method="POST", target=self.path, headers=headers))
        return head + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())

    async def _exchange(self, rec: RequestRecord, item: WorkItem, clock: Clock) -> None:
        conn = h11.Connection(h11.CLIENT)
        request = self._request(conn, item)
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(request)
            await writer.drain()
            await self._read_response(conn, reader, rec, clock)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _read_response(self, conn, reader, rec: RequestRecord, clock: Clock) -> None:
        sse, status, err_body, done = SseParser(), 0, b"", False
        usage_total: int | None = None
        t = clock()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(65536))
                t = clock()  # every payload of this read arrived now
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data) and status != 200:
                err_body = (err_body + event.data)[:500]
            elif isinstance(event, h11.Data):
                for payload in sse.feed(event.data):
                    if payload.strip() == "[DONE]":
                        done = True
                        continue
                    usage_total = self._on_chunk(rec, json.loads(payload), t, usage_total)
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
        if status != 200:
            rec.error_code, rec.error_detail = f"HTTP_{status}", err_body.decode("utf-8", "replace")
        elif not rec.error_code and not (rec.token_times_s and (done or rec.finish_reason)):
            rec.error_code, rec.error_detail = "INCOMPLETE_STREAM", "stream ended early or without tokens"
        if usage_total is not None:
            rec.output_tokens = usage_total

    @staticmethod
    def _on_chunk(rec: RequestRecord, data: dict, t: float, usage_total: int | None) -> int | None:
        if "error" in data:
            rec.error_code, rec.error_detail = "STREAM_ERROR", json.dumps(data["error"])[:500]
            return usage_total
        usage = data.get("usage") or {}
        total = usage.get("completion_tokens")
        if choices := data.get("choices"):
            c = choices[0]
            if total is not None:
                n = total - rec.streamed_tokens
            else:  # no running usage: a chunk is one token, unless it only closes the stream
                closing = c.get("finish_reason") and not (
                    c.get("text") or (c.get("delta") or {}).get("content")
                )
                n = 0 if closing else 1
            if n >= 1:  # a chunk adding no token (role or finish only) is no token message
                rec.add_message(t, n)
            rec.finish_reason = c.get("finish_reason") or rec.finish_reason
        if usage:
            rec.prompt_tokens = usage.get("prompt_tokens") or rec.prompt_tokens
            details = usage.get("prompt_tokens_details") or {}
            rec.cached_tokens = details.get("cached_tokens") or rec.cached_tokens
        return total if total is not None else usage_total

    async def close(self) -> None:
        return None


def make_client(target: str, *, grpc_service: str = "router", model: str = "") -> StreamClient:
    """``grpc://HOST:PORT`` (router, or a decode worker with grpc_service="decode")
    or ``http://HOST:PORT`` (OpenAI-compatible). Call from a running event loop."""
    if target.startswith("grpc://"):
        return GrpcClient(target.removeprefix("grpc://"), grpc_service)
    if target.startswith("http://"):
        return OpenAIHttpClient(target, model)
    raise ValueError(f"target must be grpc://HOST:PORT or http://HOST:PORT, got {target!r}")


async def run_load(
    items: Sequence[WorkItem],
    target: str | StreamClient,
    *,
    max_requests: int,
    max_duration_s: float,
    timeout_s: float = 60.0,
    grpc_service: str = "router",
    model: str = "",
) -> list[RequestRecord]:
    """Send ``items`` open-loop at their arrival times; return one record each.

    Only items arriving before ``max_duration_s`` are sent, at most
    ``max_requests`` of them; each has the deadline ``timeout_s``, so the run
    ends by ``max_duration_s + timeout_s``. Record times are seconds on a
    monotonic clock that starts with the run.
    """
    check_bounds(max_requests, max_duration_s, timeout_s)
    todo = [it for it in sorted(items, key=lambda it: it.arrival_s) if it.arrival_s < max_duration_s]
    todo = todo[:max_requests]
    client = (
        make_client(target, grpc_service=grpc_service, model=model) if isinstance(target, str) else target
    )
    run_id = uuid.uuid4().hex[:8]
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    try:
        for i, item in enumerate(todo):
            # Pacing the arrival process, not synchronisation; a loop because a
            # timer may fire a clock tick early and send_s must not precede arrival_s.
            while (delay := item.arrival_s - clock()) > 0:
                await asyncio.sleep(delay)
            rec = RequestRecord(
                f"lg-{run_id}-{i}", item.arrival_s, clock(), len(item.prompt_ids), item.max_tokens
            )
            records.append(rec)
            tasks.append(asyncio.create_task(client.generate(rec, item, clock, timeout_s)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        if isinstance(target, str):
            await client.close()
    return records


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="grpc://HOST:PORT or http://HOST:PORT")
    p.add_argument("--grpc-service", choices=("router", "decode"), default="router")
    p.add_argument("--model", default="", help="model name for OpenAI endpoints")
    p.add_argument("--trace", choices=("mooncake", "azure", "poisson"), required=True)
    p.add_argument("--trace-file", type=Path, help="default: shared/traces/<file> of the checkout")
    p.add_argument("--rate", type=float, help="requests/s before time scaling (poisson only)")
    p.add_argument("--input-len", type=int, default=128, help="poisson prompt tokens before length scaling")
    p.add_argument("--output-len", type=int, default=32, help="poisson output tokens before length scaling")
    p.add_argument("--num-requests", type=int, required=True)
    p.add_argument("--max-duration-s", type=float, required=True)
    p.add_argument("--length-scale", type=float, default=1.0, help="divide every length by this")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply every inter-arrival time by this")
    p.add_argument("--timeout-s", type=float, default=60.0, help="per-request deadline")
    p.add_argument("--slo-ttft-ms", type=float, help="default: no TTFT limit")
    p.add_argument("--slo-tpot-ms", type=float, help="default: no TPOT limit")
    p.add_argument("--vocab-size", type=int, default=256, help="prompt ids are < this")
    p.add_argument("--special-ids", default="", help="comma-separated ids prompts must avoid")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="per-request records, JSONL")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = _parse_args(argv)
    check_bounds(a.num_requests, a.max_duration_s, a.timeout_s)
    scaling = f"length_factor={a.length_scale:g} time_factor={a.time_scale:g}"
    special = frozenset(int(x) for x in a.special_ids.split(",") if x.strip())
    items = build_workload(
        a.trace,
        num_requests=a.num_requests,
        max_duration_s=a.max_duration_s,
        length_factor=a.length_scale,
        time_factor=a.time_scale,
        rate=a.rate,
        seed=a.seed,
        vocab=VocabRange(0, a.vocab_size, special),
        input_len=a.input_len,
        output_len=a.output_len,
        trace_path=a.trace_file,
    )
    if not items:
        print(f"loadgen no requests within the bounds [{scaling}]", file=sys.stderr)
        return 2
    span = items[-1].arrival_s
    print(
        f"plan trace={a.trace} target={a.target} requests={len(items)} span_s={span:.1f} "
        f"mean_in={np.mean([len(i.prompt_ids) for i in items]):.1f} "
        f"mean_out={np.mean([i.max_tokens for i in items]):.1f}  [{scaling}]"
    )
    records = asyncio.run(
        run_load(
            items,
            a.target,
            max_requests=a.num_requests,
            max_duration_s=a.max_duration_s,
            timeout_s=a.timeout_s,
            grpc_service=a.grpc_service,
            model=a.model,
        )
    )
    meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    write_records(a.out, records, meta={**meta, "length_factor": a.length_scale, "time_factor": a.time_scale})
    s = summarize(
        records,
        math.inf if a.slo_ttft_ms is None else a.slo_ttft_ms / 1e3,
        math.inf if a.slo_tpot_ms is None else a.slo_tpot_ms / 1e3,
    )
    print(format_summary(s, scaling))
    kv = {**summary_kv(s), "length_factor": f"{a.length_scale:g}", "time_factor": f"{a.time_scale:g}"}
    print("loadgen " + " ".join(f"{k}={v}" for k, v in kv.items()))
    return 0 if s.ok else 1


if __name__ == "__main__":
    sys.exit(main())
