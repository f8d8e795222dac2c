"""`pdmesh up --planner` under a load ramp: 1 decode worker, then 3, then 1 again, with every
request completed token-exact (issue 20's done-when).

Real processes: `pdmesh up` (its supervisor runs the planner and the local actuator), the
router, the decode workers it starts and drains, the gateway. The sizing starts from a timing
profile written here (a decode step of 100 ms + 50 ms per sequence, at most 2 sequences a
worker), so that the arrival rates the test sends, small enough for a shared CPU, need 1, 2 or
3 workers by the planner's own sizing (`ceil(rate * 24 tokens * 0.2 s / 2)`); the profile is
the planner's model of a worker, not a stand-in for one (the workers are real tiny-model
engines). The reference is a greedy run of each prompt straight at decode-0 (no router, so
it is no load the planner sees); every routed request, whatever worker served it and whether
it was retried off a draining one, must give the same tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from pdmesh.v1 import common_pb2, decode_pb2, decode_pb2_grpc, router_pb2, router_pb2_grpc
from tests.e2e.helpers import wait_until

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 24
PROMPTS = [[(7 * i + 3 * j) % 200 + 10 for j in range(12 + i)] for i in range(6)]
PROFILE = {
    "planner-e2e": {
        "source": "tests/e2e/test_planner_up.py: a slow worker, so that a few requests a second need 3",
        "prefill": [1.0, 0.01, 0.0, 0.0],
        "decode_form": "linear",
        "decode": [100.0, 50.0, 0.0],
        "decode_min_ms": 0.0,
        "kv_bytes_per_token": 1024,
        "kv_bandwidth_gbps": 10.0,
        "num_blocks": 1024,
        "block_size": 16,
        "max_num_seqs": 2,
        "max_num_batched_tokens": 256,
    }
}
PLANNER_ENV = {
    "PDMESH_ITL_SLO_S": "0.5",  # x headroom 0.85: a 2-sequence step (200 ms) fits, a 3rd would not
    "PDMESH_STARTUP_S": "5",
    "PDMESH_PEAK_WINDOW_S": "2",  # no burst memory: the ramp's end should bring the size down
    "PDMESH_UP_COOLDOWN_S": "0",
    "PDMESH_DOWN_COOLDOWN_S": "3",
    "PDMESH_DOWN_AFTER": "3",
}


def _sampling() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _reference(decode_address: str) -> list[list[int]]:
    out = []
    with grpc.insecure_channel(decode_address) as ch:
        stub = decode_pb2_grpc.DecodeServiceStub(ch)
        for i, prompt in enumerate(PROMPTS):
            req = decode_pb2.DecodeServiceGenerateRequest(
                request_id=f"ref-{i}", prompt_token_ids=prompt, sampling=_sampling()
            )
            tokens = [
                t for m in stub.Generate(req, timeout=120) if m.HasField("tokens") for t in m.tokens.token_ids
            ]
            out.append(tokens)
    return out


def _decode_workers(internal: str) -> list[router_pb2.WorkerStatus]:
    with grpc.insecure_channel(internal) as ch:
        listed = router_pb2_grpc.RouterServiceStub(ch).ListWorkers(
            router_pb2.ListWorkersRequest(), timeout=10
        )
    return [w for w in listed.workers if w.info.role == common_pb2.WORKER_ROLE_DECODE]


def _serving(internal: str) -> int:
    return sum(w.health == router_pb2.WORKER_HEALTH_SERVING for w in _decode_workers(internal))


class Load:
    """Open-loop arrivals at a settable rate; every request's tokens are kept for the check."""

    def __init__(self, public: str):
        self.public = public
        self.rate = 0.0
        self.results: list[tuple[int, list[int] | BaseException]] = []
        self.sent = 0

    async def one(self, stub, i: int) -> None:
        k = i % len(PROMPTS)
        req = router_pb2.GenerateRequest(
            request_id=f"load-{i}", token_ids=common_pb2.TokenIds(ids=PROMPTS[k]), sampling=_sampling()
        )
        try:
            tokens = [
                t
                async for m in stub.Generate(req, timeout=300)
                if m.HasField("delta")
                for t in m.delta.token_ids
            ]
            self.results.append((k, tokens))
        except grpc.aio.AioRpcError as e:
            self.results.append((k, e))

    async def run(self, stop: asyncio.Event) -> None:
        async with grpc.aio.insecure_channel(self.public) as ch:
            stub = router_pb2_grpc.RouterServiceStub(ch)
            tasks = []
            next_at = time.monotonic()
            while not stop.is_set():
                if self.rate > 0 and time.monotonic() >= next_at:
                    tasks.append(asyncio.create_task(self.one(stub, self.sent)))
                    self.sent += 1
                    next_at = time.monotonic() + 1.0 / self.rate
                await asyncio.sleep(0.02)  # the arrival clock's tick, not synchronisation
            await asyncio.gather(*tasks)


@pytest.fixture
def planner_up(tmp_path):
    profile = tmp_path / "profiles.json"
    profile.write_text(json.dumps(PROFILE))
    cmd = [
        sys.executable, "-m", "pdmesh.cli", "up",
        "--prefill", "0", "--decode", "1", "--preset", "tiny",
        "--router-port", "0", "--gateway-port", "0", "--workdir", str(tmp_path / "up"),
        "--planner", "--min-decode", "1", "--max-decode", "3", "--planner-interval", "5",
        "--planner-profile", "planner-e2e", "--planner-profile-file", str(profile),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDMESH_")} | PLANNER_ENV
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()

    def found(pattern: str):
        return next((m for line in lines if (m := re.search(pattern, line))), None) or (
            proc.poll() is not None and pytest.fail("pdmesh up exited:\n" + "".join(lines))
        )

    try:
        public = wait_until(lambda: found(r"serving on (\S+) \(router\)"), timeout=300, what="up").group(1)
        internal = wait_until(
            lambda: found(r"\(pdmesh workers\) use (\S+)"), timeout=10, what="internal"
        ).group(1)
        state = wait_until(lambda: found(r"--planner-state (\S+)"), timeout=10, what="planner").group(1)
        yield {"public": public, "internal": internal, "state": Path(state), "lines": lines}
    finally:
        proc.send_signal(signal.SIGTERM)  # pdmesh up drains and stops every service it started
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(5)
    assert proc.returncode == 0, "".join(lines)[-3000:]  # drained and stopped, not killed


async def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := await asyncio.to_thread(pred)):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.5)  # polling the router's view of the pool
    return value


async def test_planner_scales_decode_1_to_3_and_back_losing_nothing(planner_up):
    internal = planner_up["internal"]
    (d0,) = _decode_workers(internal)
    reference = await asyncio.to_thread(_reference, d0.info.address)
    assert _serving(internal) == 1

    load = Load(planner_up["public"])
    stop = asyncio.Event()
    runner = asyncio.create_task(load.run(stop))
    seen = [1]

    def count() -> int:
        n = _serving(internal)
        if n != seen[-1]:
            seen.append(n)
        return n

    try:
        load.rate = 0.2  # 1 worker's worth
        await _wait(lambda: load.sent >= 3, 60, "the first requests")
        load.rate = 1.5  # ceil(1.5 * 24 * 0.2 / 2) = 4, capped by --max-decode 3
        await _wait(lambda: count() >= 3, 240, "3 decode workers")
        load.rate = 0.2  # back to 1 worker's worth: the planner drains two while requests run
        await _wait(
            lambda: count() == 1 and len(_decode_workers(internal)) == 1, 300, "1 decode worker again"
        )
        await _wait(lambda: load.sent >= 3 + 3, 60, "requests after the scale-down")
    finally:
        stop.set()
        await runner

    assert max(seen) == 3 and seen[0] == 1 and seen[-1] == 1, seen
    failed = [r for _, r in load.results if isinstance(r, BaseException)]
    assert not failed, failed[:3]
    assert len(load.results) == load.sent
    for k, tokens in load.results:
        assert tokens == reference[k], f"prompt {k}: {tokens} != {reference[k]}"
    state = json.loads(planner_up["state"].read_text())
    assert state["decode"] == 1 and state["reason"]
    # `pdmesh workers` shows the pool and the planner's last decision with its reason and inputs
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdmesh",
            "workers",
            "--address",
            internal,
            "--planner-state",
            str(planner_up["state"]),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert "decode" in shown.stdout and "planner: prefill" in shown.stdout, shown.stdout
    # (the reason itself may have moved on by now: the planner keeps deciding every interval)
    assert re.search(r"why: \S+", shown.stdout) and "planner inputs: " in shown.stdout, shown.stdout
    text = "".join(planner_up["lines"])
    assert "crashed" not in text  # no worker the planner stopped was taken for a crash
