"""The planner inside `pdmesh up --planner`: its loop on a thread of the supervisor process.

The supervisor owns the worker processes, so the planner runs where it can
start and stop them: `LocalPlanner` builds the core (services/planner) from
`pdmesh up`'s flags and the `PDMESH_*` variables of the planner's config
(`PDMESH_TTFT_SLO_S`, `PDMESH_ITL_SLO_S`, `PDMESH_UP_COOLDOWN_S`, ... as
`python -m services.planner.main --help` lists them), reads the router's
internal listener like the planner service does, and applies decisions with
the `LocalActuator` (pdmesh/local_actuator.py). Its last decision goes to
`<workdir>/planner.json`, which `pdmesh workers --planner-state` prints.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pdmesh.local_actuator import LauncherWorkers, LocalActuator
from services.common.config import build
from services.planner.capacity import profile_model
from services.planner.hysteresis import HysteresisConfig
from services.planner.loop import PlannerLoop
from services.planner.planner import Planner, PlannerConfig
from services.planner.stats_reader import StatsReader

STATE_FILE = "planner.json"


def add_planner_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("planner (with --planner; SLOs and cooldowns: PDMESH_* variables)")
    g.add_argument("--planner", action="store_true", help="size the worker pools with the planner")
    g.add_argument("--min-decode", type=int, default=1, help="fewest decode workers the planner keeps")
    g.add_argument("--max-decode", type=int, default=4, help="most decode workers the planner starts")
    g.add_argument("--min-prefill", type=int, default=None, help="fewest prefill workers (default --prefill)")
    g.add_argument("--max-prefill", type=int, default=None, help="most prefill workers (default --prefill)")
    g.add_argument("--planner-interval", type=float, default=None, help="seconds between decisions")
    g.add_argument(
        "--planner-profile", default="cpu-small-bfloat16", help="timing profile the sizing starts from"
    )
    g.add_argument("--planner-profile-file", default=None, help="a JSON file of timing profiles")


def planner_config(args: argparse.Namespace, env: Mapping[str, str]) -> PlannerConfig:
    min_p = args.prefill if args.min_prefill is None else args.min_prefill
    max_p = args.prefill if args.max_prefill is None else args.max_prefill
    overrides: dict[str, Any] = dict(
        min_prefill=min_p, max_prefill=max_p, min_decode=args.min_decode, max_decode=args.max_decode
    )
    overrides["max_workers"] = max_p + args.max_decode
    if args.planner_interval is not None:
        overrides["interval_s"] = args.planner_interval
    config = build(PlannerConfig, None, env, **overrides)
    return dataclasses.replace(config, hysteresis=build(HysteresisConfig, None, env))


def check_planner_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the planner flags (None when they are fine)."""
    if not getattr(args, "planner", False):
        return None
    if not args.min_decode <= args.decode <= args.max_decode:
        return f"--decode {args.decode} must lie in [--min-decode {args.min_decode}, --max-decode {args.max_decode}]"
    if args.min_decode < 1:
        return "--min-decode must be >= 1"
    try:  # the SLOs, cooldowns and the profile: refused now, not after the mesh started
        planner_config(args, os.environ)
        profile_model(args.planner_profile, args.planner_profile_file)
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        return f"planner: {e}"
    return None


class LocalPlanner:
    def __init__(
        self,
        launcher: Any,
        args: argparse.Namespace,
        started: dict[str, Any],
        *,
        tls: Any = None,
        cert_flags: Callable[[str, str], tuple[str, ...]] = lambda role, name: (),
        env: Mapping[str, str] | None = None,
    ):
        env = os.environ if env is None else env
        config = planner_config(args, env)
        self.planner = Planner(config, profile_model(args.planner_profile, args.planner_profile_file))
        router = started["router"]
        self.state_file = Path(launcher.workdir) / STATE_FILE
        initial = {
            role: [s for n, s in started.items() if n.startswith(f"{role}-")]
            for role in ("prefill", "decode")
        }
        templates = {role: ws[0].spec for role, ws in initial.items() if ws}
        processes = LauncherWorkers(
            launcher, templates, router.internal_address, tls=tls, cert_flags=cert_flags,
            ready_timeout_s=args.timeout,
        )  # fmt: skip
        self.actuator = LocalActuator(processes, initial, on_startup=self.planner.observe_startup)
        self._router_internal = router.internal_address
        self._tls = tls
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="planner", daemon=True)
        self.error: BaseException | None = None

    def owns(self, svc: Any) -> bool:
        """The planner is stopping this worker: the supervisor leaves it alone."""
        return id(svc) in self.actuator.retiring

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception as e:  # the mesh keeps serving at its size; say so once
            self.error = e
            print(f"pdmesh up: the planner stopped: {e!r}; the pools keep their size", file=sys.stderr)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        reader = StatsReader(self._router_internal, self._tls, worker_stats=True)
        loop = PlannerLoop(self.planner, reader, self.actuator, state_file=self.state_file)
        try:
            await loop.run(self._stop)
        finally:
            await self.actuator.close()  # starts and drains in progress end first
            await reader.close()

    def stop(self, timeout_s: float = 300.0) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)


def print_planner_state(path: str, out: Any = None) -> int:
    """`pdmesh workers --planner-state F`: the last decision, its reason and inputs."""
    out = out or sys.stdout
    try:
        state = json.loads(Path(path).read_text())
    except FileNotFoundError:
        print(f"planner: no decision yet ({path} does not exist)", file=out)
        return 0
    except (OSError, ValueError) as e:
        print(f"pdmesh workers: cannot read {path}: {e}", file=sys.stderr)
        return 1
    age = time.time() - float(state.get("at_unix_s", 0))
    print(
        f"planner: prefill {state['prefill']}  decode {state['decode']}  "
        f"({'changed' if state['changed'] else 'unchanged'}, {age:.0f}s ago)  why: {state['reason']}",
        file=out,
    )
    inputs = "  ".join(f"{k}={v:.3g}" for k, v in sorted(state.get("inputs", {}).items()))
    print(f"planner inputs: {inputs}  startup_s={state.get('startup_s', 0):.1f}", file=out)
    return 0
