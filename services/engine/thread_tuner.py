"""Intra-op threads per step: each class of step size runs on one thread or on all, whichever measures faster.

Why: a step runs many OpenMP parallel regions, each ending in a barrier. On a CPU shared with
other work the second thread is often descheduled and every barrier waits up to a scheduler
slice for it. Session 8 (AMD EPYC, 2 vCPUs, one busy process beside; torch.profiler of SmolLM2
int4 batch-1 decode): 547 ms a step on 2 threads against 42 ms on 1, and the ops that open a
region (121 int4 matmuls, 60 bmm, 30 softmax a step) averaged ~3.3 ms each against 3-57 us
alone, while the inline small ops were unchanged; with OMP_WAIT_POLICY=PASSIVE the spinning
stops (CPU 285 -> 37 ms a step) but the waits do not (80-94 ms). On a quiet machine the second
thread helps instead (8.3-9.0 ms against 10.0-10.5 on 1). Neither fixed choice is right
everywhere, so the engine measures both and keeps the faster, per class of step size
(StepThreadTuner): prompt chunks suffer the same waits (a 71-185 token prompt 3.2 s to its first
token on 2 threads under load). The choice changes timing only where a step's result does not
depend on its thread count (checked bitwise in test_thread_tuner.py). That holds on some CPUs
and dtypes and not on others (bf16 on an Intel Xeon with AMX differed), so the engine probes it
at start (LLMEngine._probe_thread_invariance) and runs without the tuner where it fails.

Exploration is budgeted in time, not steps: the losing arm is tried again only while the time
spent on tries stays under `explore_share` of the small steps' time, so a losing arm that costs
50x (the loaded case above) is tried rarely and a close one often. Plain Python, no torch: the
runner applies the number.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TunerConfig:
    max_threads: int  # the engine's thread count (the "all" arm)
    small_rows: int = 8  # steps of at most this many tokens are tuned
    explore_share: float = 0.03  # most of the small steps' time spent trying the other arm
    alpha: float = 0.25  # EWMA weight of a new sample
    min_samples: int = 3  # samples of each arm before the comparison is trusted
    clear_ratio: float = 3.0  # ... or one sample each, when one arm is this many times the other


@dataclass
class _Arm:
    threads: int
    ewma: float | None = None
    samples: int = 0

    def add(self, seconds: float, alpha: float) -> None:
        self.ewma = seconds if self.ewma is None else (1 - alpha) * self.ewma + alpha * seconds
        self.samples += 1


@dataclass
class ThreadTuner:
    config: TunerConfig
    _arms: tuple[_Arm, _Arm] = field(init=False)
    _small_time: float = 0.0
    _explore_time: float = 0.0
    _exploring: bool = False

    def __post_init__(self) -> None:
        self._arms = (_Arm(1), _Arm(self.config.max_threads))

    @property
    def enabled(self) -> bool:
        return self.config.max_threads > 1

    def best(self) -> int:
        """The arm's thread count small steps use now (all threads until both are measured)."""
        one, full = self._arms
        if one.ewma is None or full.ewma is None:
            return full.threads
        return one.threads if one.ewma < full.ewma else full.threads

    def threads_for(self, rows: int) -> int:
        """Threads for a step of `rows` tokens; call `record` with its time after it ran."""
        if not self.enabled or rows > self.config.small_rows:
            self._exploring = False
            return self.config.max_threads
        under = [a for a in self._arms if a.samples < self.config.min_samples]
        if under and self._clear_winner():
            under = [a for a in under if a.samples == 0]
        if under:  # measure each arm a few times before trusting either (once, if far apart)
            self._exploring = True
            return under[0].threads
        best = self.best()
        other = self._arms[0].threads if best != self._arms[0].threads else self._arms[1].threads
        self._exploring = self._explore_time < self.config.explore_share * self._small_time
        return other if self._exploring else best

    def _clear_winner(self) -> bool:
        """Both arms measured and one over `clear_ratio` x the other: more samples of the slow
        one would cost more than they could tell (a loaded 2-thread step: 3.8 s against 0.17)."""
        one, full = self._arms
        if one.ewma is None or full.ewma is None:
            return False
        lo, hi = sorted((one.ewma, full.ewma))
        return hi > self.config.clear_ratio * lo

    def record(self, rows: int, threads: int, seconds: float) -> None:
        if not self.enabled or rows > self.config.small_rows:
            return
        arm = self._arms[0] if threads == self._arms[0].threads else self._arms[1]
        if self._exploring and arm.samples >= self.config.min_samples and arm.threads != self.best():
            # A retry of the losing arm: its estimate is as old as its last try (dozens of steps
            # ago), so the fresh sample replaces it instead of moving it by `alpha`. Otherwise one
            # slow early sample (the first 2-thread step of a run, the pool starting) kept a faster
            # arm losing for a hundred steps: SmolLM2 int4 batch 1, near-quiet, 8.5 ms on 2 threads
            # against 10.4 on 1, and the tuner ran 1.
            arm.ewma, arm.samples = seconds, arm.samples + 1
        else:
            arm.add(seconds, self.config.alpha)
        self._small_time += seconds
        if self._exploring:
            self._explore_time += seconds

    def stats(self) -> dict[str, float]:
        one, full = self._arms
        return {
            "best_threads": self.best(),
            "one_thread_ms": -1.0 if one.ewma is None else one.ewma * 1e3,
            "all_threads_ms": -1.0 if full.ewma is None else full.ewma * 1e3,
            "explore_share": self._explore_time / self._small_time if self._small_time else 0.0,
        }


# Step sizes tuned apart (rows per step): decode of a few sequences, larger decode batches,
# prompt chunks, long chunks. Each class has its own two arms; above the first class a sample is
# time per row, as the rows of a class's steps vary several-fold.
ROW_CLASSES = (8, 64, 512)


class StepThreadTuner:
    """A ThreadTuner per class of step size, so prompt chunks are tuned too (session 8: SmolLM2
    int4 at 2 threads beside two busy processes, small steps already on one thread, a 71-185
    token prompt still took 3.2 s to its first token on 2 threads; llama.cpp's 0.35 s).
    `stats()` is the first (small-step) class's, with every class's under "classes"."""

    def __init__(self, max_threads: int, bounds: tuple[int, ...] = ROW_CLASSES):
        self.bounds = bounds
        limits = (*bounds, 1 << 62)
        self.tuners = [ThreadTuner(TunerConfig(max_threads, small_rows=b)) for b in limits]

    @property
    def enabled(self) -> bool:
        return self.tuners[0].enabled

    def _class(self, rows: int) -> int:
        return bisect_left(self.bounds, rows)

    def threads_for(self, rows: int) -> int:
        return self.tuners[self._class(rows)].threads_for(rows)

    def record(self, rows: int, threads: int, seconds: float) -> None:
        c = self._class(rows)
        self.tuners[c].record(rows, threads, seconds if c == 0 else seconds / max(rows, 1))

    def stats(self) -> dict:
        out: dict = dict(self.tuners[0].stats())
        out["classes"] = [{"max_rows": t.config.small_rows, **t.stats()} for t in self.tuners]
        return out
