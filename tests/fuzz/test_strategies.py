"""The fuzzers' own draws stay bounded: a draw once took a 24 GB test process down.

A long run (200,000 copies) of a message holding two 5,000-character strings is
4 GB on the wire; built and serialized, it held 16 GB of the test process
before any server saw it (a server refuses it at 4 MiB anyway). Each built
message is cut at MAX_DRAW_BYTES, still over every server's cap.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdmesh.v1 import common_pb2, decode_pb2
from tests.fuzz.inproc import MAX_MESSAGE_BYTES
from tests.fuzz.strategies import MAX_DRAW_BYTES, MessageStrategies, _build

Request = decode_pb2.DecodeServiceGenerateRequest
LONG = "\u00e9" * 5000  # 10,000 bytes of UTF-8


def test_a_long_run_of_long_strings_is_cut_at_the_draw_budget():
    sampling = _build(common_pb2.SamplingParams, {"stop": [LONG] * 4000})  # 40 MB uncut
    msg = _build(Request, {"sampling": sampling, "request_id": "r"})
    assert MAX_MESSAGE_BYTES < msg.ByteSize() <= MAX_DRAW_BYTES + 16
    assert 0 < len(msg.sampling.stop) < 4000 and all(s == LONG for s in msg.sampling.stop)


def test_a_long_run_of_messages_is_cut_with_what_each_one_holds_counted():
    candidate = _build(decode_pb2.PrefillCandidate, {"worker_id": LONG, "address": LONG})
    msg = _build(Request, {"prompt_token_ids": [7] * 300_000, "prefill_candidates": [candidate] * 4000})
    assert MAX_MESSAGE_BYTES < msg.ByteSize() <= MAX_DRAW_BYTES + 32
    assert len(msg.prompt_token_ids) == 300_000  # fields are cut in turn, first come first served
    assert 0 < len(msg.prefill_candidates) < 4000


def test_an_oversized_draw_still_goes_over_the_servers_cap():
    msg = _build(Request, {"prompt_token_ids": [2**31 - 1] * 1_000_000})
    assert msg.ByteSize() > MAX_MESSAGE_BYTES


def test_the_budget_is_a_few_times_the_cap_not_gigabytes():
    assert 2 * MAX_MESSAGE_BYTES <= MAX_DRAW_BYTES <= 8 * MAX_MESSAGE_BYTES


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_drawn_request_is_within_the_budget(data):
    msg = data.draw(MessageStrategies().message(Request))
    assert msg.ByteSize() <= 2 * MAX_DRAW_BYTES
