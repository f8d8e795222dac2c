"""OpenAI request bodies -> `GenerationPlan`, checked field by field (plain Python).

What is supported, and how it maps onto `pdmesh.v1.SamplingParams`:
  max_tokens (chat: max_completion_tokens first), temperature (default 1.0, as
  OpenAI), top_p, seed, stop (string or list), stream,
  stream_options.include_usage (and vLLM's continuous_usage_stats), n (1 only), and the vLLM extensions
  ignore_eos, top_k and stop_token_ids.
Parameters that would change the output in ways pdmesh cannot honour (n > 1,
best_of > 1, echo, logprobs, suffix, tools, logit_bias, penalties, a JSON
response_format) are refused with a 400 instead of being silently ignored.
Unknown fields are ignored, as OpenAI-compatible servers do. Range checks the
router owns (max_tokens limit, context length, stop count) are left to it; its
INVALID_ARGUMENT comes back as a 400 too.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Any

from pdmesh.v1 import common_pb2, router_pb2
from services.gateway.chat_template import ChatTemplate, parse_messages
from services.gateway.errors import bad_request

UINT64_MAX = 2**64 - 1


@dataclass(frozen=True)
class GenerationPlan:
    """One generation the gateway will ask the router for, and how to answer it."""

    kind: str  # "completion" | "chat"
    request_id: str
    model: str
    prompt_text: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    # vLLM's stream_options.continuous_usage_stats: every chunk carries the running usage.
    continuous_usage: bool = False

    def to_proto(self) -> router_pb2.GenerateRequest:
        sampling = common_pb2.SamplingParams(
            temperature=self.temperature,
            top_p=0.0 if self.top_p >= 1.0 else self.top_p,  # 0 = unset (= 1, off)
            top_k=self.top_k,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
        )
        if self.max_tokens is not None:
            sampling.max_tokens = self.max_tokens
        if self.seed is not None:
            sampling.seed = self.seed
        req = router_pb2.GenerateRequest(request_id=self.request_id, sampling=sampling)
        if self.prompt_token_ids is not None:
            req.token_ids.ids.extend(self.prompt_token_ids)
        else:
            req.text = self.prompt_text or ""
        return req


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"{name}: must be an integer, got {v!r}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad_request(f"{name}: must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}", name)
    return v


def _float(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad_request(f"{name}: must be a number, got {v!r}", name)
    if v > hi or v < lo or (lo_open and v == lo):
        raise bad_request(f"{name}: must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", name)
    return float(v)


def _bool(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad_request(f"{name}: must be true or false, got {v!r}", name)
    return v


def _token_list(v: Any, name: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise bad_request(f"{name}: must be a list of token ids", name)
    if any(t < 0 for t in v):
        raise bad_request(f"{name}: token ids must be >= 0", name)
    return tuple(v)


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(v)
    raise bad_request("stop: must be a string or a list of strings", "stop")


def _refuse_unsupported(body: dict) -> None:
    """400 for parameters whose effect pdmesh cannot deliver."""
    n = _int(body, "n")
    if n is not None and n != 1:
        raise bad_request("n: only n=1 is supported", "n")
    best_of = _int(body, "best_of")
    if best_of is not None and best_of != 1:
        raise bad_request("best_of: only best_of=1 is supported", "best_of")
    for name in ("echo", "suffix", "logprobs", "top_logprobs", "tools", "functions", "logit_bias"):
        if body.get(name) not in (None, False, 0, [], {}, ""):
            raise bad_request(f"{name}: not supported by this server", name)
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise bad_request(f"{name}: only 0 is supported", name)
    if body.get("repetition_penalty") not in (None, 1, 1.0):
        raise bad_request("repetition_penalty: only 1 is supported", "repetition_penalty")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") in (None, "text")):
        raise bad_request("response_format: only {'type': 'text'} is supported", "response_format")


def _check_model(body: dict, served: str) -> str:
    model = body.get("model")
    if model in (None, ""):
        return served
    if model != served:
        raise bad_request(
            f"The model `{model}` does not exist; this server serves `{served}`", "model", "model_not_found"
        )
    return served


def _common(body: dict, served: str, kind: str) -> dict[str, Any]:
    _refuse_unsupported(body)
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options: must be an object", "stream_options")
    if options and not stream:
        raise bad_request("stream_options: only allowed when stream is true", "stream_options")
    include_usage = bool(options and _bool(options, "include_usage"))
    continuous_usage = bool(options and _bool(options, "continuous_usage_stats"))
    top_k = _int(body, "top_k", -1)
    stop_ids = body.get("stop_token_ids")
    return {
        "kind": kind,
        "request_id": f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}",
        "model": _check_model(body, served),
        "temperature": _float(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        "top_k": 0 if top_k in (None, -1) else top_k,
        "seed": _int(body, "seed", 0, UINT64_MAX),
        "stop": _stop(body),
        "stop_token_ids": () if stop_ids is None else _token_list(stop_ids, "stop_token_ids"),
        "ignore_eos": _bool(body, "ignore_eos"),
        "stream": stream,
        "include_usage": include_usage,
        "continuous_usage": continuous_usage,
    }


def parse_completion(body: dict[str, Any], served: str) -> GenerationPlan:
    """`/v1/completions`: one prompt (a string or token ids; a list of one is accepted)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    text, ids = None, None
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        ids = _token_list(prompt, "prompt")
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad_request("prompt: one prompt per request (batches are not supported)", "prompt")
    else:
        raise bad_request("prompt: must be a string or a list of token ids", "prompt")
    if text == "" or ids == ():
        raise bad_request("prompt: must not be empty", "prompt")
    return GenerationPlan(
        prompt_text=text,
        prompt_token_ids=ids,
        max_tokens=_int(body, "max_tokens", 1),
        **_common(body, served, "completion"),
    )


def parse_chat(body: dict[str, Any], served: str, template: ChatTemplate) -> GenerationPlan:
    """`/v1/chat/completions`: messages rendered by the model's chat template."""
    common = _common(body, served, "chat")
    messages = parse_messages(body.get("messages"))
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    prompt = template.render(messages)
    return GenerationPlan(
        prompt_text=prompt.text, prompt_token_ids=prompt.token_ids, max_tokens=max_tokens, **common
    )
