"""`make run` brings up the mesh and `pdmesh generate "Hello"` streams an answer.

Runs the real Makefile target (the venv already exists, so it goes straight to
`pdmesh up`) with port 0 for the public ports, then the CLI against it, then
stops it with SIGINT (Ctrl-C) and checks every service exited.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
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
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: pdmesh up drains and stops every service
        proc.wait(60)
        reader.join(5)
    assert "draining and stopping" in "".join(lines)
    pids = [int(p.read_text().split('"pid": ')[1].split("}")[0]) for p in workdir.glob("*.port.json")]
    assert pids and all(not _alive(pid) for pid in pids)


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
