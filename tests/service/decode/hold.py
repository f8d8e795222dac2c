"""`StepHold`: hold a TorchEngine's step thread from a test, as a wedged accelerator would.

A stand-in for what cannot be made to happen on demand here (a deadlocked or hung
device): it wraps the engine core's `step()` (the step thread calls `core.step()`,
so an instance attribute takes its place) and blocks in it while held.
"""

from __future__ import annotations

import threading


class StepHold:
    """Wraps LLMEngine.step on the engine thread: `hold()` makes the next step block
    until `release()`; `entered` is set once the thread is blocked in it."""

    def __init__(self, core):
        self._inner = core.step
        self._open = threading.Event()
        self._open.set()
        self.entered = threading.Event()
        core.step = self  # the step thread calls core.step(): this instance attribute

    def __call__(self):
        if not self._open.is_set():
            self.entered.set()
            self._open.wait()
        return self._inner()

    def hold(self) -> None:
        self.entered.clear()
        self._open.clear()

    def release(self) -> None:
        self._open.set()
