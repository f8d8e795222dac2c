"""Which objects a piece of work left in reference cycles, for the garbage collector.

A serving process's request path should leave none: reference counting frees a finished
request at once, while cycles wait for a collection, and a collection of thousands of
them stops the event loop for milliseconds (the router's shed-storm p99 and the HTTP
door's tail in issues 16 and 18). Usage:

    with CycleWatch() as watch:
        ... run requests ...
    assert watch.left(RequestFlow, DecodeAttempt) == []
"""

from __future__ import annotations

import gc


class CycleWatch:
    def __enter__(self) -> CycleWatch:
        gc.collect()
        gc.garbage.clear()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds goes to gc.garbage, not freed
        self._garbage: list[object] = []
        return self

    def __exit__(self, *exc) -> None:
        gc.collect()
        self._garbage = list(gc.garbage)
        gc.set_debug(0)
        gc.garbage.clear()

    def left(self, *types: type) -> list[str]:
        """The names of the objects of `types` that were found in cycles."""
        return sorted(type(o).__qualname__ for o in self._garbage if isinstance(o, types))
