"""Steady greedy load with known answers, and the outcome check.

`references` asks the undisturbed mesh for each prompt's greedy output once.
`SteadyLoad` runs `threads` closed-loop clients against the router, each with
its own channel (fast reconnects), every request with a deadline; each
outcome records how the call ended, whether the tokens equal the reference,
and how long it took. `check_outcomes` is the per-episode invariant: every
completed request equals its undisturbed run token for token, every failure
is a clear status, and no call outlived its deadline.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass

import grpc

from pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.chaos.harness import CLIENT_OPTIONS

# What a client may be told while the mesh is being hurt: try again, too slow, shed.
CLEAR = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}
SLACK_S = 3.0  # a client-side deadline fires on time; this only absorbs scheduling


def prompts(n: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens): short ones (local prefill) and long ones (remote, > 32 tokens)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.choice([5, 12, 40, 90, 160]) if i % 2 else rng.choice([60, 120, 200])
        out.append(([rng.randrange(256) for _ in range(length)], rng.choice([24, 48, 64])))
    return out


def request(prompt: list[int], max_tokens: int, request_id: str = "") -> router_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return router_pb2.GenerateRequest(
        request_id=request_id, token_ids=common_pb2.TokenIds(ids=prompt), sampling=sampling
    )


def generate(stub, prompt, max_tokens, timeout: float, request_id: str = "") -> tuple[list[int], object]:
    tokens: list[int] = []
    final = None
    for msg in stub.Generate(request(prompt, max_tokens, request_id), timeout=timeout):
        if msg.HasField("delta"):
            tokens += msg.delta.token_ids
        else:
            final = msg.final
    return tokens, final


def references(address: str, work: list[tuple[list[int], int]], timeout: float = 60.0) -> list[list[int]]:
    with grpc.insecure_channel(address, options=CLIENT_OPTIONS) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        out = []
        for prompt, max_tokens in work:
            tokens, final = generate(stub, prompt, max_tokens, timeout)
            assert final is not None and len(tokens) == max_tokens
            out.append(tokens)
        return out


@dataclass(frozen=True)
class Outcome:
    item: int
    code: str  # "OK" or the status name ("INCOMPLETE" when OK without a final message)
    tokens_ok: bool | None  # None unless the call finished OK
    elapsed_s: float
    ended_at: float  # time.monotonic() when it ended
    detail: str = ""
    migrations: int = 0


class SteadyLoad:
    def __init__(
        self,
        address: str,
        work: list[tuple[list[int], int]],
        expected: list[list[int]],
        *,
        threads: int = 3,
        deadline_s: float = 15.0,
        seed: int = 0,
    ):
        self.address = address
        self.work = work
        self.expected = expected
        self.deadline_s = deadline_s
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(random.Random(seed * 100 + i), i), daemon=True)
            for i in range(threads)
        ]

    def start(self) -> SteadyLoad:
        for t in self._threads:
            t.start()
        return self

    def ok_since(self, t: float) -> int:
        with self._lock:
            return sum(o.code == "OK" and o.ended_at >= t for o in self.outcomes)

    def stop(self) -> list[Outcome]:
        """Let every client finish its call in flight, then return all outcomes."""
        self._stop.set()
        for t in self._threads:
            t.join(self.deadline_s + 10)
        hung = [t.name for t in self._threads if t.is_alive()]
        assert not hung, f"clients still in a call {self.deadline_s + 10:.0f} s after stop: {hung}"
        return list(self.outcomes)

    def _client(self, rng: random.Random, index: int) -> None:
        with grpc.insecure_channel(self.address, options=CLIENT_OPTIONS) as ch:
            stub = router_pb2_grpc.RouterServiceStub(ch)
            n = 0
            while not self._stop.is_set():
                item = rng.randrange(len(self.work))
                outcome = self._one(stub, item, f"c{index}-{n}-{rng.getrandbits(32):x}")
                self._record(outcome)
                n += 1
                if outcome.code != "OK":  # a client paces its retries (no busy loop on a dead router)
                    self._stop.wait(rng.uniform(0.05, 0.2))

    def _one(self, stub, item: int, request_id: str) -> Outcome:
        prompt, max_tokens = self.work[item]
        t0 = time.monotonic()
        try:
            tokens, final = generate(stub, prompt, max_tokens, self.deadline_s, request_id)
        except grpc.RpcError as e:
            end = time.monotonic()
            return Outcome(item, e.code().name, None, end - t0, end, e.details() or "")
        end = time.monotonic()
        if final is None:
            return Outcome(item, "INCOMPLETE", None, end - t0, end, "stream ended without a final message")
        return Outcome(item, "OK", tokens == self.expected[item], end - t0, end, "", final.migrations)

    def _record(self, outcome: Outcome) -> None:
        with self._lock:
            self.outcomes.append(outcome)


def check_outcomes(outcomes: list[Outcome], deadline_s: float, what: str) -> Counter:
    """The per-episode invariant; returns the count of each ending."""
    codes = Counter(o.code for o in outcomes)
    wrong = [o for o in outcomes if o.code == "OK" and not o.tokens_ok]
    unclear = [o for o in outcomes if o.code not in CLEAR | {"OK"}]
    late = [o for o in outcomes if o.elapsed_s > deadline_s + SLACK_S]
    assert not wrong, f"{what}: {len(wrong)} completed requests differ from the undisturbed run: {wrong[:3]}"
    assert not unclear, f"{what}: unclear failures {unclear[:3]} (all: {dict(codes)})"
    assert not late, f"{what}: calls outlived their {deadline_s} s deadline: {late[:3]}"
    assert codes["OK"] > 0, f"{what}: nothing completed ({dict(codes)})"
    return codes
