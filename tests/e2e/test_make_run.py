"""`make run` brings up the mesh and `pdmesh generate "Hello"` streams an answer.

Runs the real Makefile target (the venv already exists, so it goes straight to
`pdmesh up`) with port 0 for the public ports, then the CLI against it, then
stops it with SIGINT (Ctrl-C) and checks every service exited. Every test that
starts a mesh escalates to SIGTERM and SIGKILL in `finally` (stop_mesh), so a
mesh that ignores Ctrl-C fails the test instead of outliving it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from pdmesh.client import health_check
from tests.e2e.helpers import wait_until

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_make_run_serves_pdmesh_generate(tmp_path):
    workdir = tmp_path / "up"
    # The built-in model: this test is about `make run` itself (test_default_model.py covers SmolLM2).
    args = f"--model builtin-tiny --router-port 0 --gateway-port 0 --workdir {workdir}"
    cmd = ["make", "-s", "run", f"ARGS={args}"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        serving = wait_until(
            lambda: next(
                (m for line in lines if (m := re.search(r"serving on (\S+) \(router\)", line))), None
            ),
            timeout=240,
            what="pdmesh up to print its endpoint",
        )
        address = serving.group(1)
        services = [
            m.groups() for line in lines if (m := re.match(r"\s+(\S+)\s+(\d+\.\d+\.\d+\.\d+:\d+)\s", line))
        ]
        assert {name for name, _ in services} >= {"kvtransfer", "prefill-0", "decode-0", "router"}
        for name, addr in services:
            assert health_check(addr)[0] == "SERVING", name

        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdmesh.cli",
                "generate",
                "--address",
                address,
                "Hello",
                "--max-tokens",
                "12",
                "--ignore-eos",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert "[5 prompt + 12 output tokens" in out.stdout
    finally:
        # Ctrl-C: pdmesh up drains and stops every service; escalate if it does not.
        stopped_by_sigint = stop_mesh(proc, workdir, lambda: os.killpg(proc.pid, signal.SIGINT))
        reader.join(5)
    assert stopped_by_sigint, "pdmesh up ignored Ctrl-C"
    assert "draining and stopping" in "".join(lines)
    pids = service_pids(workdir)
    assert pids and all(not _alive(pid) for pid in pids)


def service_pids(workdir: Path) -> list[int]:
    """PIDs of the services a `pdmesh up` started, from their port files."""
    return [json.loads(p.read_text())["pid"] for p in workdir.glob("*.port.json")]


def stop_mesh(proc: subprocess.Popen, workdir: Path, first: Callable[[], None]) -> bool:
    """Stop a `pdmesh up` we started: `first` (e.g. SIGINT), then SIGTERM, then SIGKILL, and
    SIGKILL any of its services still alive (by the PIDs it wrote). True if `first` sufficed."""
    if proc.poll() is None:
        first()
    try:
        proc.wait(60)
        return True
    except subprocess.TimeoutExpired:
        pass
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    for pid in service_pids(workdir):
        if _alive(pid) and not _zombie(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return False


def read_lines(proc: subprocess.Popen) -> tuple[list[str], threading.Thread]:
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    return lines, reader


def test_up_survives_a_worker_exit_restarts_it_and_stops_on_sigint_even_if_inherited_ignored(tmp_path):
    """A background job inherits SIGINT as ignored (`trap '' INT`); `pdmesh up` must still stop
    on it. Meanwhile a decode worker that drains and exits is reported and, with --restart,
    started again; the mesh stays up."""
    workdir = tmp_path / "up"
    up = f"{sys.executable} -m pdmesh.cli up --router-port 0 --gateway-port 0 --restart --workdir {workdir}"
    proc = subprocess.Popen(
        ["bash", "-c", f"trap '' INT; exec {up}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines, reader = read_lines(proc)
    text = lambda: "".join(lines)  # noqa: E731
    try:
        serving = wait_until(
            lambda: re.search(r"serving on (\S+) \(router\)", text()), timeout=240, what="pdmesh up serving"
        )
        router = serving.group(1)
        # Every service prints its metrics port.
        shown = [line for line in lines if re.match(r"\s+(kvtransfer|decode-0|prefill-0|router)\s", line)]
        assert len(shown) == 4 and all(re.search(r"metrics :\d+", line) for line in shown), shown

        decode_pid = json.loads((workdir / "decode-0.port.json").read_text())["pid"]
        os.kill(decode_pid, signal.SIGTERM)  # a drain: the worker exits 0
        wait_until(lambda: "decode-0 is back" in text(), timeout=240, what="decode-0 restarted")
        assert "decode-0 drained and exited" in text()
        assert proc.poll() is None, text()  # the mesh stayed up
        wait_until(lambda: health_check(router, "pdmesh.v1.RouterService")[0] == "SERVING", timeout=60)
        new_pid = json.loads((workdir / "decode-0.port.json").read_text())["pid"]
        assert new_pid != decode_pid
    finally:
        stopped_by_sigint = stop_mesh(proc, workdir, lambda: proc.send_signal(signal.SIGINT))
        reader.join(5)
    assert stopped_by_sigint, "pdmesh up ignored SIGINT it had inherited as ignored"
    assert proc.returncode == 0 and "draining and stopping" in text()
    assert all(not _alive(pid) or _zombie(pid) for pid in service_pids(workdir))
    # Logs are JSON lines only: no gRPC C-core, NIXL or UCX text among them.
    for log in workdir.glob("*.log"):
        for line in log.read_text().splitlines():
            if line.strip():
                assert isinstance(json.loads(line), dict), f"{log.name}: {line[:200]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_services_stop_when_the_launcher_is_killed(tmp_path):
    """SIGKILL the launching process (no chance to clean up): its services drain and exit anyway."""
    script = (
        "import sys, time\n"
        "from pdmesh.launcher import Launcher, ServiceSpec\n"
        f"l = Launcher({str(tmp_path)!r})\n"
        "svc = l.start_ready(ServiceSpec('kvtransfer', 'services.kvtransfer.main',"
        " ready_service='pdmesh.v1.KvTransferService'))\n"
        "print(svc.proc.pid, flush=True)\n"
        "time.sleep(3600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.kill()
    parent.wait()
    wait_until(lambda: not _alive(child) or _zombie(child), timeout=30, what="the orphaned service to exit")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (FileNotFoundError, IndexError):
        return False
