"""bench.loadgen OpenAI SSE client against an in-process asyncio HTTP server on port 0."""

import asyncio
import json

import pytest

from bench.loadgen import WorkItem, run_load

# The fake's behaviour is chosen by the first prompt token.
USAGE, NO_USAGE, OVERLOADED, TRUNCATED, ERROR_EVENT = 1, 2, 3, 4, 5


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def chunk(text, finish=None, completion_tokens=None):
    out = {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if completion_tokens is not None:
        out["usage"] = {"prompt_tokens": 3, "completion_tokens": completion_tokens}
    return out


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class FakeOpenAI:
    def __init__(self):
        self.bodies: list[dict] = []
        self.paths: list[str] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        request_line, *header_lines = head.decode().split("\r\n")
        self.paths.append(request_line.split()[1])
        headers = dict(h.lower().split(": ", 1) for h in header_lines if h)
        body = json.loads(await reader.readexactly(int(headers["content-length"])))
        self.bodies.append(body)
        mode = body["prompt"][0]
        if mode == OVERLOADED:
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 10\r\n\r\noverloaded")
        elif mode == NO_USAGE:
            # No length and no chunking: the body ends when the connection closes.
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
            writer.write(sse(chunk("a")) + sse(chunk("b")) + b": keep-alive\n\n")
            # The last text chunk, then a closing chunk with only a finish reason: no token.
            writer.write(sse(chunk("c")) + sse(chunk("", finish="length")) + sse(b"[DONE]"))
        else:
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            if mode == USAGE:
                events = sse(chunk("a", completion_tokens=1)) + sse(chunk("bc", completion_tokens=3))
                # One event split across two HTTP chunks, then a finish-only chunk adding no token.
                tail = sse(chunk("d", completion_tokens=4))
                writer.write(http_chunk(events) + http_chunk(tail[:9]) + http_chunk(tail[9:]))
                writer.write(http_chunk(sse(chunk("", finish="length", completion_tokens=4))))
                final = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}
                writer.write(http_chunk(sse(final) + sse(b"[DONE]")))
            elif mode == TRUNCATED:
                writer.write(http_chunk(sse(chunk("a"))))
            elif mode == ERROR_EVENT:
                writer.write(http_chunk(sse(chunk("a")) + sse({"error": {"message": "engine died"}})))
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()
        await writer.wait_closed()


@pytest.fixture
async def http_server():
    fake = FakeOpenAI()
    srv = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", fake
    srv.close()
    await srv.wait_closed()


async def test_sse_client_counts_tokens_from_continuous_usage(http_server):
    target, fake = http_server
    (rec,) = await run_load(
        [WorkItem(0.0, (USAGE, 9), 4)], target, max_requests=1, max_duration_s=5, timeout_s=10, model="tiny"
    )
    assert rec.ok, rec.error_detail
    assert rec.token_counts == [1, 2, 1] and rec.output_tokens == 4
    assert rec.finish_reason == "length" and rec.prompt_tokens == 3
    assert rec.send_s <= rec.token_times_s[0] <= rec.token_times_s[-1] <= rec.end_s
    assert fake.paths == ["/v1/completions"]
    (body,) = fake.bodies
    assert body["prompt"] == [USAGE, 9] and body["max_tokens"] == 4 and body["model"] == "tiny"
    assert body["stream"] is True and body["ignore_eos"] is True


async def test_sse_client_without_usage_counts_one_token_per_chunk(http_server):
    target, _ = http_server
    (rec,) = await run_load([WorkItem(0.0, (NO_USAGE,), 3)], target, max_requests=1, max_duration_s=5)
    assert rec.ok, rec.error_detail
    assert rec.token_counts == [1, 1, 1] and rec.output_tokens == 3
    assert rec.finish_reason == "length"


async def test_sse_client_records_failures(http_server):
    target, _ = http_server
    items = [WorkItem(0.0, (mode,), 3) for mode in (OVERLOADED, TRUNCATED, ERROR_EVENT)]
    overloaded, truncated, errored = await run_load(items, target, max_requests=3, max_duration_s=5)
    assert (
        not overloaded.ok and overloaded.error_code == "HTTP_503" and overloaded.error_detail == "overloaded"
    )
    assert not truncated.ok and truncated.error_code == "INCOMPLETE_STREAM" and truncated.token_counts == [1]
    assert not errored.ok and errored.error_code == "STREAM_ERROR" and "engine died" in errored.error_detail


async def test_sse_client_connection_refused_is_unavailable():
    srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    srv.close()
    await srv.wait_closed()
    (rec,) = await run_load(
        [WorkItem(0.0, (1,), 1)], f"http://127.0.0.1:{port}", max_requests=1, max_duration_s=1
    )
    assert not rec.ok and rec.error_code == "UNAVAILABLE"
