"""Not part of TensorRT-LLM: the machinery behind the fake (see the package docstring)."""
