"""`die_with_parent` ties a service to its launcher *process*: a service started from a thread
that then ends keeps running, and the service goes when the launcher is killed. Real processes:
a launcher that starts the service from a short-lived thread (as bench/faults.py restarts a
worker from its fault schedule), then a SIGKILL of the launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support.poll import wait_until

ROOT = Path(__file__).resolve().parents[3]

SERVICE = textwrap.dedent(
    """
    import sys
    from services.common.server import die_with_parent
    die_with_parent()
    print("ready", flush=True)
    for line in sys.stdin:
        print(line.strip(), flush=True)
    """
)

LAUNCHER = textwrap.dedent(
    """
    import os, subprocess, sys, threading
    from services.common.server import PARENT_PID_ENV
    from tests.support.poll import wait_until
    env = dict(os.environ, **{PARENT_PID_ENV: str(os.getpid())})
    held = {}

    def start():
        held["p"] = p = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, env=env)
        assert p.stdout.readline().strip() == "ready"

    t = threading.Thread(target=start)
    t.start()
    t.join()
    # join returns before the OS thread is gone; wait until it is
    wait_until(lambda: len(os.listdir("/proc/self/task")) == 1, what="the starting thread to exit")
    p = held["p"]
    p.stdin.write("ping\\n")
    p.stdin.flush()
    print(p.stdout.readline().strip() or "dead", flush=True)
    print(p.pid, flush=True)
    sys.stdin.readline()
    """
)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie nobody reaped yet
    except FileNotFoundError:
        return True


def test_service_outlives_the_thread_that_started_it_and_dies_with_the_launcher():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, SERVICE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    child = None
    try:
        assert launcher.stdout.readline().strip() == "ping", "the service died when its starting thread ended"
        child = int(launcher.stdout.readline())
        launcher.kill()
        launcher.wait(30)
        wait_until(lambda: _gone(child), what="the service to go with its launcher")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(30)
        if child is not None and not _gone(child):
            os.kill(child, signal.SIGKILL)
