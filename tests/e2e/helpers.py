"""Helpers for e2e tests: start real service processes on loopback, talk to them.

Every process binds port 0 and reports its port through a port file (see
pdmesh.launcher); tests wait on health and on observable state, never on time.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from pdmesh.launcher import Launcher, RunningService, ServiceSpec, flags
from pdmesh.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc, worker_pb2
from tests.support.poll import wait_until  # noqa: F401 (re-exported to the e2e tests)

ROOT = Path(__file__).resolve().parents[2]

TINY = flags(engine_preset="tiny", engine_num_threads=1)


@dataclass
class Mesh:
    launcher: Launcher
    kv: RunningService | None = None
    prefills: list[RunningService] = field(default_factory=list)
    decodes: list[RunningService] = field(default_factory=list)

    def decode_stub(self, i: int = 0) -> decode_pb2_grpc.DecodeServiceStub:
        return decode_pb2_grpc.DecodeServiceStub(grpc.insecure_channel(self.decodes[i].address))

    def decode_stats(self, i: int = 0) -> worker_pb2.StatsResponse:
        return self.decode_stub(i).Stats(worker_pb2.StatsRequest(), timeout=10)

    def prefill_stats(self, i: int = 0) -> worker_pb2.StatsResponse:
        stub = prefill_pb2_grpc.PrefillServiceStub(grpc.insecure_channel(self.prefills[i].address))
        return stub.Stats(worker_pb2.StatsRequest(), timeout=10)

    def close(self) -> None:
        self.launcher.close()


def start_mesh(
    workdir,
    prefill: int = 1,
    decode: int = 1,
    decode_args: tuple[str, ...] = (),
    prefill_args: tuple[str, ...] = (),
    kv_transport: str = "nixl",
) -> Mesh:
    """kvtransfer + prefill workers + decode workers (decode knows the prefills statically)."""
    launcher = Launcher(workdir)
    mesh = Mesh(launcher)
    try:
        mesh.kv = launcher.start_ready(
            ServiceSpec("kvtransfer", "services.kvtransfer.main", ready_service="pdmesh.v1.KvTransferService")
        )
        common = flags(kvtransfer_address=mesh.kv.address, kv_transport=kv_transport, metrics_port=0) + TINY
        mesh.prefills = [
            launcher.start(
                ServiceSpec(
                    f"prefill-{i}",
                    "services.prefill.main",
                    flags(worker_id=f"prefill-{i}") + common + prefill_args,
                    ready_service="pdmesh.v1.PrefillService",
                )
            )
            for i in range(prefill)
        ]
        for p in mesh.prefills:
            launcher.wait_ready(p)
        static = flags(prefill_workers=[p.address for p in mesh.prefills] or None)
        mesh.decodes = [
            launcher.start(
                ServiceSpec(
                    f"decode-{i}",
                    "services.decode.main",
                    flags(worker_id=f"decode-{i}") + common + static + decode_args,
                    ready_service="pdmesh.v1.DecodeService",
                )
            )
            for i in range(decode)
        ]
        for d in mesh.decodes:
            launcher.wait_ready(d)
    except BaseException:
        launcher.close()
        raise
    return mesh


def start_decodes_and_router(
    launcher: Launcher, n: int, decode_args: tuple[str, ...], router_args: tuple[str, ...]
) -> tuple[list[RunningService], RunningService]:
    """`n` decode workers (ids decode-0..) started together, then a router that knows them
    statically; the launcher stops them all."""
    decodes = [
        launcher.start(
            ServiceSpec(
                f"decode-{i}",
                "services.decode.main",
                flags(worker_id=f"decode-{i}") + decode_args,
                ready_service="pdmesh.v1.DecodeService",
            )
        )
        for i in range(n)
    ]
    for d in decodes:
        launcher.wait_ready(d)
    router = launcher.start_ready(
        ServiceSpec(
            "router",
            "services.router.main",
            router_args + flags(decode_workers=[d.address for d in decodes]),
            ready_service="pdmesh.v1.RouterService",
        )
    )
    return decodes, router


def generate(
    stub: decode_pb2_grpc.DecodeServiceStub,
    prompt: list[int],
    *,
    request_id: str,
    mode: int = decode_pb2.DISAGG_MODE_UNSPECIFIED,
    max_tokens: int = 16,
    temperature: float = 0.0,
    seed: int | None = None,
    timeout: float = 60.0,
) -> tuple[list[int], decode_pb2.DecodeFinal]:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature)
    if seed is not None:
        sampling.seed = seed
    req = decode_pb2.DecodeServiceGenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=sampling, disagg_mode=mode
    )
    tokens: list[int] = []
    final = None
    for msg in stub.Generate(req, timeout=timeout):
        if msg.HasField("tokens"):
            tokens += msg.tokens.token_ids
        else:
            final = msg.final
    assert final is not None, "stream ended without a final message"
    return tokens, final


def scrape(svc: RunningService) -> str:
    assert svc.metrics_port, f"{svc.spec.name} has no metrics port"
    with urllib.request.urlopen(f"http://{svc.spec.host}:{svc.metrics_port}/metrics", timeout=10) as r:
        return r.read().decode()


def metric_value(text: str, name: str, **labels: str) -> float:
    """Value of one sample in Prometheus text format (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        got = ",".join(sorted(label_text.rstrip("}").split(","))) if label_text else ""
        if metric == name and got == want:
            return float(value)
    return 0.0


class UpProcess:
    """`pdmesh up ARGS` as a child in its own session, its output collected line by line by a
    thread; `found(pattern)` is the first matching line (pytest.fail with the output once it has
    exited); `stop(sig)` sends `sig` to the session, then SIGKILL if it outlives `wait_s`."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        if env is None:  # the caller's PDMESH_* settings would change what the test starts
            env = {k: v for k, v in os.environ.items() if not k.startswith("PDMESH_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdmesh.cli", "up", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(
            target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")), daemon=True
        )
        self._reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def found(self, pattern: str) -> re.Match | None:
        match = next((m for line in self.lines if (m := re.search(pattern, line))), None)
        if match is None and self.proc.poll() is not None:
            pytest.fail("pdmesh up exited:\n" + self.output)
        return match

    def stop(self, sig: int = signal.SIGINT, wait_s: float = 90) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._reader.join(5)
