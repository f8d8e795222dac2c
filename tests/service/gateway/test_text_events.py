"""The streamed text events from pre-encoded halves are byte-for-byte the chunk they replace."""

import json

import pytest

from services.gateway import responses as R
from services.gateway.params import GenerationPlan
from tests.service.gateway import httpio

TEXTS = [
    "A",
    "",
    "héllo ✓",
    'quote " and \\ backslash',
    "new\nline\ttab\x00nul",
    "\x00pdmesh-text",
    "x" * 500,
    "line\u2028and\u2029paragraph\x85next\x1c\x1d\x1e\x0b\x0c separators",
]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_text_events_equal_the_chunk_encoding(kind, include_usage):
    plan = GenerationPlan(
        kind=kind, request_id='cmpl-"1"', model="m/ü", stream=True, include_usage=include_usage
    )
    events = R.TextEvents(plan, 1_700_000_000)
    for text in TEXTS:
        assert events.event(text) == R.sse(R.chunk(plan, 1_700_000_000, text))


def test_continuous_usage_chunks_are_not_templated():
    plan = GenerationPlan(kind="completion", request_id="r", model="m", stream=True, continuous_usage=True)
    with pytest.raises(ValueError):
        R.TextEvents(plan, 0)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_counted_text_events_equal_the_continuous_usage_chunk_encoding(kind):
    plan = GenerationPlan(kind=kind, request_id='cmpl-"1"', model="m/ü", stream=True, continuous_usage=True)
    events = R.CountedTextEvents(plan, 1_700_000_000)
    for n, text in enumerate(TEXTS):
        for count in (0, n, 987_654_321, 10**15):
            assert events.event(text, count) == R.sse(
                R.chunk(plan, 1_700_000_000, text, completion_tokens=count)
            )


def test_counted_text_events_are_only_for_continuous_usage():
    plan = GenerationPlan(kind="completion", request_id="r", model="m", stream=True)
    with pytest.raises(ValueError):
        R.CountedTextEvents(plan, 0)


def test_a_text_with_unicode_line_separators_stays_one_sse_event():
    """The tiny model's byte-level text can hold U+2028, U+0085 (valid unescaped in JSON):
    a stream of such events parses by the SSE grammar, one payload per event."""
    plan = GenerationPlan(kind="completion", request_id="r", model="m", stream=True)
    events = R.TextEvents(plan, 0)
    body = b"".join(events.event(t) for t in TEXTS) + b"data: [DONE]\n\n"
    parsed = httpio.sse_events(body)
    assert [p["choices"][0]["text"] for p in parsed[:-1]] == TEXTS and parsed[-1] == "[DONE]"


@pytest.mark.parametrize("continuous_usage", [False, True])
def test_events_survive_a_splitlines_line_reader(continuous_usage):
    """httpx's `iter_lines` (under httpx-sse and the clients built on it) splits like
    `str.splitlines`, which also breaks at U+2028, U+2029 and U+0085: each event's
    JSON must stay on one such line and decode to the text sent."""
    plan = GenerationPlan(
        kind="chat", request_id="r", model="m\u2028x", stream=True, continuous_usage=continuous_usage
    )
    if continuous_usage:
        events = R.CountedTextEvents(plan, 0)
        body = b"".join(events.event(t, n) for n, t in enumerate(TEXTS))
    else:
        events = R.TextEvents(plan, 0)
        body = b"".join(events.event(t) for t in TEXTS)
    body += R.sse(R.chunk(plan, 0, None, "stop")) + R.DONE
    lines = [line for line in body.decode().splitlines() if line]
    assert all(line.startswith("data: ") for line in lines)
    payloads = [line[len("data: ") :] for line in lines]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == [*TEXTS, None]
    assert {c["model"] for c in chunks} == {"m\u2028x"}
