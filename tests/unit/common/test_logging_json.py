"""Every log line of a service is one JSON object, stdlib `logging` records included
(issue 15 item 5: grpc/asyncio lines were plain text among the JSON)."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import logging
from services.common.logging import configure_logging
log = configure_logging("svc")
log.info("structured", k=1)
logging.getLogger("grpc._cython").warning("from the stdlib %s", "logger")
"""


def test_stdlib_log_records_are_json_lines_too():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True
    )
    lines = [json.loads(line) for line in out.stderr.splitlines() if line.strip()]
    assert [line["event"] for line in lines] == ["structured", "from the stdlib logger"]
    assert lines[1]["logger"] == "grpc._cython" and lines[1]["level"] == "warning"
