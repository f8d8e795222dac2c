"""OpenAI request bodies -> `GenerationPlan` (the body is decoded by schema.py first).

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
INVALID_ARGUMENT comes back as a 400 too. A model other than the served one is a
404 (`model_not_found`), as OpenAI and vLLM answer.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from pdmesh.v1 import common_pb2, router_pb2
from services.gateway.chat_template import ROLES, ChatTemplate
from services.gateway.errors import GatewayError, bad_request
from services.gateway.schema import (
    ChatBody,
    CompletionBody,
    SamplingBody,
    StreamOptions,
    decode,
    decode_token_ids,
)


@dataclass(frozen=True)
class WorkflowHint:
    """The request's place in an agent workflow (pdmesh.v1.WorkflowContext), from headers."""

    workflow_id: str
    step_index: int = 0
    tokens_spent: int = 0
    final_step: bool = False


# Issue 21: the workflow context over HTTP. Our own headers, and Dynamo's session headers
# (X-Dynamo-Session-ID / X-Dynamo-Session-Final, its canonical agent identity) as aliases,
# so a harness written for Dynamo gets affinity, pins and sunk-cost scheduling here too.
WORKFLOW_ID_HEADERS = ("x-workflow-id", "x-dynamo-session-id")
WORKFLOW_FINAL_HEADERS = ("x-workflow-final", "x-dynamo-session-final")
WORKFLOW_STEP_HEADER = "x-workflow-step"
WORKFLOW_SPENT_HEADER = "x-workflow-tokens-spent"
MAX_WORKFLOW_ID_BYTES = 128  # the router's limit (validation.max_request_id_bytes)
_TRUE, _FALSE = ("true", "1"), ("false", "0")


def _header(headers: Any, names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = headers.get(name)
        if value is not None:
            return name, value
    return None


def _count(headers: Any, name: str, limit: int) -> int | None:
    value = headers.get(name)
    if value is None:
        return None
    value = value.strip()
    if not (value.isascii() and value.isdigit()) or int(value) > limit:
        raise bad_request(f"{name}: must be an integer in [0, {limit}], got {value[:40]!r}", name)
    return int(value)


def workflow_from_headers(headers: Any) -> WorkflowHint | None:
    """The workflow context of a request's headers (a case-insensitive mapping), None
    without one. A malformed value is a 400, not ignored: a harness that sends a broken
    step index would otherwise lose its affinity and sunk-cost protection silently."""
    found = _header(headers, WORKFLOW_ID_HEADERS)
    step = _count(headers, WORKFLOW_STEP_HEADER, 2**32 - 1)
    spent = _count(headers, WORKFLOW_SPENT_HEADER, 2**63 - 1)
    final_header = _header(headers, WORKFLOW_FINAL_HEADERS)
    if found is None:
        if step is not None or spent is not None or final_header is not None:
            raise bad_request(
                "workflow step headers need X-Workflow-Id (or X-Dynamo-Session-ID)", "x-workflow-id"
            )
        return None
    name, wid = found
    wid = wid.strip()
    if not wid or not (wid.isascii() and wid.isprintable()) or len(wid) > MAX_WORKFLOW_ID_BYTES:
        raise bad_request(f"{name}: must be 1-{MAX_WORKFLOW_ID_BYTES} printable ASCII characters", name)
    final = False
    if final_header is not None:
        fname, fvalue = final_header
        flag = fvalue.strip().lower()
        if flag not in _TRUE + _FALSE:
            raise bad_request(f"{fname}: must be true or false, got {fvalue[:40]!r}", fname)
        final = flag in _TRUE
    return WorkflowHint(wid, step or 0, spent or 0, final)


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
    workflow: WorkflowHint | None = None

    def to_proto(self, token_ids: bool = True) -> router_pb2.GenerateRequest:
        """The GenerateRequest; `token_ids=False` leaves a token-id prompt out (the router's
        HTTP door hands the ids to the flow as they are: copying 2k ids into a repeated
        field and out again cost ~180 us a request)."""
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
            if token_ids:
                req.token_ids.ids.extend(self.prompt_token_ids)
        else:
            req.text = self.prompt_text or ""
        if self.workflow is not None:
            w = self.workflow
            req.workflow.CopyFrom(
                common_pb2.WorkflowContext(
                    workflow_id=w.workflow_id,
                    step_index=w.step_index,
                    tokens_spent=w.tokens_spent,
                    final_step=w.final_step,
                )
            )
        return req


# Parameters refused unless unset or neutral (their raw JSON, whitespace removed).
UNSUPPORTED = ("echo", "suffix", "logprobs", "top_logprobs", "tools", "functions", "logit_bias")
_NEUTRAL = {b"null", b"false", b"0", b"0.0", b"[]", b"{}", b'""'}


def _neutral(raw: msgspec.Raw) -> bool:
    data = bytes(raw)
    return len(data) <= 16 and b"".join(data.split()) in _NEUTRAL


def _refuse_unsupported(body: SamplingBody) -> None:
    """400 for parameters whose effect pdmesh cannot deliver (n and best_of: the schema)."""
    for name in UNSUPPORTED:
        if not _neutral(getattr(body, name)):
            raise bad_request(f"{name}: not supported by this server", name)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0.0):
            raise bad_request(f"{name}: only 0 is supported", name)
    if body.repetition_penalty not in (None, 1.0):
        raise bad_request("repetition_penalty: only 1 is supported", "repetition_penalty")
    fmt = body.response_format
    if fmt is not None and fmt.type not in (None, "text"):
        raise bad_request("response_format: only {'type': 'text'} is supported", "response_format")


def _check_model(model: str | None, served: str) -> str:
    if model in (None, "") or model == served:
        return served
    raise GatewayError(
        404,
        f"The model `{model}` does not exist; this server serves `{served}`",
        "not_found_error",
        "model",
        "model_not_found",
    )


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _common(body: SamplingBody, served: str, kind: str) -> dict[str, Any]:
    model = _check_model(body.model, served)
    _refuse_unsupported(body)
    stream = bool(body.stream)
    options = body.stream_options
    if options is not None and not stream and options != StreamOptions():  # {} is harmless
        raise bad_request("stream_options: only allowed when stream is true", "stream_options")
    return {
        "kind": kind,
        "request_id": f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}",
        "model": model,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": 0 if body.top_k in (None, -1) else body.top_k,
        "seed": body.seed,
        "stop": _stop(body.stop),
        "stop_token_ids": tuple(body.stop_token_ids or ()),
        "ignore_eos": bool(body.ignore_eos),
        "stream": stream,
        "include_usage": bool(options and options.include_usage),
        "continuous_usage": bool(options and options.continuous_usage_stats),
    }


def _prompt(prompt: Any) -> tuple[str | None, tuple[int, ...] | None]:
    """(text, token ids) of a completion prompt: a string, token ids, or a batch of one."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if prompt == "":
            raise bad_request("prompt: must not be empty", "prompt")
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return None, tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise bad_request("prompt: one prompt per request (batches are not supported)", "prompt")
    if prompt == []:
        raise bad_request("prompt: must not be empty", "prompt")
    raise bad_request("prompt: must be a string or a list of token ids", "prompt")


def parse_completion(raw: bytes, served: str) -> GenerationPlan:
    """`/v1/completions` from its raw body: one prompt (a string or token ids)."""
    fast = decode_token_ids(raw)  # token ids, checked while decoding: no Python pass over them
    if fast is not None:
        common = _common(fast, served, "completion")
        return GenerationPlan(
            prompt_text=None, prompt_token_ids=tuple(fast.prompt), max_tokens=fast.max_tokens, **common
        )
    body = decode(raw, CompletionBody)
    common = _common(body, served, "completion")
    text, ids = _prompt(body.prompt)
    return GenerationPlan(prompt_text=text, prompt_token_ids=ids, max_tokens=body.max_tokens, **common)


def _messages(body: ChatBody) -> list[dict[str, str]]:
    if body.messages is None:
        raise bad_request("messages: is required (a non-empty list)", "messages")
    out = []
    for i, m in enumerate(body.messages):
        param = f"messages[{i}]"
        if m.role not in ROLES:
            raise bad_request(f"{param}.role: must be one of {ROLES}, got {m.role!r}", f"{param}.role")
        if isinstance(m.content, str):
            text = m.content
        else:
            parts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    where = f"{param}.content[{j}]"
                    raise bad_request(f"{where}: only text parts are supported", where)
                parts.append(part.text)
            text = "".join(parts)
        out.append({"role": m.role, "content": text})
    return out


def parse_chat(raw: bytes, served: str, template: ChatTemplate) -> GenerationPlan:
    """`/v1/chat/completions` from its raw body: messages rendered by the chat template."""
    body = decode(raw, ChatBody)
    common = _common(body, served, "chat")
    messages = _messages(body)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    prompt = template.render(messages)
    return GenerationPlan(
        prompt_text=prompt.text, prompt_token_ids=prompt.token_ids, max_tokens=max_tokens, **common
    )
