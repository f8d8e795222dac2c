"""`pdmesh up --planner`'s configuration and `pdmesh workers --planner-state`."""

from __future__ import annotations

import argparse
import io
import json
import time

from pdmesh.local_planner import (
    add_planner_arguments,
    check_planner_args,
    planner_config,
    print_planner_state,
)


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    add_planner_arguments(p)
    return p.parse_args(list(argv))


def test_flags_and_environment_make_the_planner_config():
    args = parse("--planner", "--prefill", "0", "--max-decode", "3", "--planner-interval", "2")
    cfg = planner_config(args, {"PDMESH_ITL_SLO_S": "0.5", "PDMESH_DOWN_AFTER": "5"})
    assert (cfg.min_prefill, cfg.max_prefill, cfg.min_decode, cfg.max_decode) == (0, 0, 1, 3)
    assert cfg.max_workers == 3 and cfg.interval_s == 2 and cfg.itl_slo_s == 0.5
    assert cfg.hysteresis.down_after == 5


def test_bad_planner_flags_are_refused_before_anything_starts():
    assert check_planner_args(parse("--decode", "5")) is None  # no --planner: nothing to check
    assert "--max-decode" in check_planner_args(parse("--planner", "--decode", "5", "--max-decode", "3"))
    assert "--min-decode" in check_planner_args(parse("--planner", "--decode", "0", "--min-decode", "0"))
    assert "unknown sim profile" in check_planner_args(parse("--planner", "--planner-profile", "nope"))


def test_workers_shows_the_last_decision_and_why(tmp_path):
    state = tmp_path / "planner.json"
    out = io.StringIO()
    assert print_planner_state(str(state), out) == 0
    assert "no decision yet" in out.getvalue()
    state.write_text(
        json.dumps(
            {
                "at_unix_s": time.time(),
                "prefill": 0,
                "decode": 3,
                "changed": True,
                "reason": "prefill:idle decode:itl",
                "startup_s": 7.5,
                "inputs": {"observed_rate": 1.5, "forecast_rate": 2.25},
            }
        )
    )
    out = io.StringIO()
    assert print_planner_state(str(state), out) == 0
    text = out.getvalue()
    assert "decode 3" in text and "why: prefill:idle decode:itl" in text and "forecast_rate=2.25" in text
