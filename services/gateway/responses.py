"""OpenAI response bodies and SSE chunks, built from a plan and router messages.

Shapes follow the OpenAI API: `text_completion` / `chat.completion` objects for
whole answers, `text_completion` / `chat.completion.chunk` objects as
`data: {...}` server-sent events for streams, ending with `data: [DONE]`.
With `stream_options.include_usage` every chunk carries `"usage": null` and one
last chunk with no choices carries the usage, as OpenAI sends it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdmesh.v1 import common_pb2
from services.gateway.params import GenerationPlan

FINISH_REASONS = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_ABORT: "abort",
}

DONE = b"data: [DONE]\n\n"


def finish_reason(value: int) -> str | None:
    return FINISH_REASONS.get(value)


def usage(u: common_pb2.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    }


def _head(plan: GenerationPlan, created: int, obj: str) -> dict[str, Any]:
    return {"id": plan.request_id, "object": obj, "created": created, "model": plan.model}


def full_body(plan: GenerationPlan, created: int, text: str, final: Any) -> dict[str, Any]:
    """The non-streaming answer; `final` is the router's GenerateFinal."""
    reason = finish_reason(final.finish_reason)
    if plan.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": reason,
        }
        body = _head(plan, created, "chat.completion")
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        body = _head(plan, created, "text_completion")
    body["choices"] = [choice]
    body["usage"] = usage(final.usage)
    return body


def chunk(
    plan: GenerationPlan,
    created: int,
    text: str | None,
    reason: str | None = None,
    first: bool = False,
    completion_tokens: int | None = None,
) -> dict[str, Any]:
    """One streamed chunk with new text (None = no content, e.g. the closing chunk)."""
    if plan.kind == "chat":
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        body = _head(plan, created, "chat.completion.chunk")
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        body = _head(plan, created, "text_completion")
    body["choices"] = [choice]
    if plan.continuous_usage and completion_tokens is not None:
        # Running count (prompt tokens come with the final usage; the router tokenizes).
        body["usage"] = {
            "prompt_tokens": 0,
            "completion_tokens": completion_tokens,
            "total_tokens": completion_tokens,
        }
    elif plan.include_usage or plan.continuous_usage:
        body["usage"] = None
    return body


def usage_chunk(plan: GenerationPlan, created: int, u: common_pb2.Usage) -> dict[str, Any]:
    obj = "chat.completion.chunk" if plan.kind == "chat" else "text_completion"
    body = _head(plan, created, obj)
    body["choices"] = []
    body["usage"] = usage(u)
    return body


_json = msgspec.json.Encoder().encode  # compact UTF-8 JSON, as json.dumps(ensure_ascii=False)


def _encode(obj: Any) -> bytes:
    """JSON for one SSE line. U+2028, U+2029 and U+0085 are valid unescaped in JSON and in
    the SSE grammar (lines end at CR/LF only), but line readers built on `str.splitlines`
    break there: httpx's `iter_lines`, and so httpx-sse and the clients built on it. A
    byte-level model's token text holds them, so they go out as JSON escapes (the same string
    once decoded). UTF-8 is self-synchronising: these byte runs are only ever those characters."""
    out = _json(obj)
    for raw, escaped in _LINE_BREAKERS:
        if raw in out:
            out = out.replace(raw, escaped)
    return out


# What `str.splitlines` breaks at that JSON leaves raw (the rest, below U+0020, JSON escapes).
_LINE_BREAKERS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))


def sse(obj: dict[str, Any]) -> bytes:
    # One per streamed event: msgspec encodes a chunk several times faster than json.dumps,
    # which was most of the HTTP door's own Python time per event (bench/profile_front.py).
    return b"data: " + _encode(obj) + b"\n\n"


_SLOT = "\x00pdmesh-text\x00"  # stands for the text while a template is built; never in output


class TextEvents:
    """The SSE event of a text chunk of one stream, from two pre-encoded halves.

    Every streamed token of a request is the same JSON object but for its text, so
    the halves around the text are encoded once per request (from `chunk` itself, so
    the bytes are exactly `sse(chunk(plan, created, text))`) and each event encodes
    only the text: no dicts to build per event. Not for `continuous_usage` streams,
    whose chunks also carry a running count."""

    def __init__(self, plan: GenerationPlan, created: int):
        if plan.continuous_usage:
            raise ValueError("continuous_usage chunks carry a count: build them with chunk()")
        whole = sse(chunk(plan, created, _SLOT))
        head, _, tail = whole.partition(_encode(_SLOT))
        self._head, self._tail = head, tail

    def event(self, text: str) -> bytes:
        return self._head + _encode(text) + self._tail


_COUNT = 987_654_321_987_654  # stands for the running count while a template is built


class CountedTextEvents:
    """`TextEvents` for `continuous_usage` streams: every chunk also carries the running
    completion-token count (twice: completion_tokens and total_tokens), so the template is
    cut around the text and both counts; the bytes are exactly
    `sse(chunk(plan, created, text, completion_tokens=n))`."""

    def __init__(self, plan: GenerationPlan, created: int):
        if not plan.continuous_usage:
            raise ValueError("only continuous_usage chunks carry a count: use TextEvents")
        whole = sse(chunk(plan, created, _SLOT, completion_tokens=_COUNT))
        head, _, rest = whole.partition(_encode(_SLOT))
        parts = rest.split(str(_COUNT).encode())
        if len(parts) != 3:  # the count appears exactly twice (completion and total)
            raise ValueError(f"unexpected usage chunk shape: {whole!r}")
        self._head, (self._mid, self._sep, self._tail) = head, parts

    def event(self, text: str, completion_tokens: int) -> bytes:
        n = str(completion_tokens).encode()
        return self._head + _encode(text) + self._mid + n + self._sep + n + self._tail
