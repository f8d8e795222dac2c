"""Fake of `tensorrt_llm/executor/utils.py`: the per-request error type."""


class RequestError(RuntimeError):
    """A request failed inside the executor (raised when its result is read)."""
