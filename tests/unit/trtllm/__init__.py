"""trtllm engine backend tests (against the fake TensorRT-LLM in tests/fakes)."""
