"""Fake of `tensorrt_llm.executor`: the result types and RequestError."""

from .result import CompletionOutput, GenerationResult
from .utils import RequestError

__all__ = ["CompletionOutput", "GenerationResult", "RequestError"]
