"""Stop strings in the client's text: cut at the first one, never show a part of it.

The decode worker ends generation when its text contains a stop string, so
the token that completes it is still streamed; the text the client sees must
not include the stop string (OpenAI and vLLM semantics). Text that could be
the start of a stop string is held back until the next delta proves it is
not, then released; the final message flushes whatever is held.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopTextFilter:
    def __init__(self, stops: Sequence[str]):
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """The part of `text` (after anything held) that is safe to show now."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        hits = [i for s in self._stops if (i := buf.find(s)) >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return buf[: min(hits)]
        keep = max(
            (k for s in self._stops for k in range(min(len(s) - 1, len(buf)), 0, -1) if buf.endswith(s[:k])),
            default=0,
        )
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """At the end of the stream: held text that never became a stop string."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out
