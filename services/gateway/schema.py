"""The OpenAI request bodies as msgspec schemas: every integer and string is bounded.

`decode_completion` / `decode_chat` turn the raw body into a typed struct in one
C pass (msgspec), before any other code looks at it, so nothing downstream can
meet a value the wire format cannot carry (a token id of 2**40, a 5,000-digit
integer, a lone UTF-16 surrogate, JSON nested 200,000 deep). Every failure is a
`GatewayError` 400 whose `param` is the public field path (`messages[0].content`).

Bounds here are what the router's wire format can carry (int32 / uint32 / uint64)
and what a 4 MiB body can hold; the serving limits (max_tokens_limit, the model
context, the stop-string counts) are the router's, and its 400s state them.
Unknown fields are ignored, as OpenAI-compatible servers do (msgspec skips them).
Parameters pdmesh cannot honour are kept as `msgspec.Raw` (not decoded) so that
params.py can refuse them when they are set to anything but their neutral value.
"""

from __future__ import annotations

import re
from typing import Annotated, TypeVar

import msgspec

from services.gateway.errors import bad_request

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
MAX_TEXT_CHARS = 4 * 1024 * 1024  # a 4 MiB body cannot carry more
MAX_ITEMS = 1024 * 1024  # token ids in a prompt, as above
MAX_STOPS = 1024  # the router's max_stop_strings / max_stop_token_ids are far lower
MAX_MESSAGES = 4096
MAX_NAME_CHARS = 256

Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=UINT32_MAX)]
TokenIds = Annotated[list[TokenId], msgspec.Meta(max_length=MAX_ITEMS)]
PositiveInt32 = Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)]
Penalty = Annotated[float, msgspec.Meta(ge=-1e6, le=1e6)]

# What a value may be, in words, for the fields whose msgspec message would name a
# wire bound instead (a client should read the rule, not "<= 2147483647").
RULES = {
    "max_tokens": "must be an integer >= 1 (the server's max_tokens limit and the model context bound it)",
    "max_completion_tokens": "must be an integer >= 1 (the server's max_tokens limit and the model context bound it)",
    "top_k": "must be -1, 0 (off) or a positive integer up to the vocabulary size",
    "seed": f"must be an integer in [0, {UINT64_MAX}]",
    "temperature": "must be a number in [0, 2]",
    "top_p": "must be a number in (0, 1]",
    "stop_token_ids": "must be a list of token ids (integers in [0, vocabulary size))",
    "prompt": "must be a string or a list of token ids (integers in [0, vocabulary size))",
    "n": "only n=1 is supported",
    "best_of": "only best_of=1 is supported",
}


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage on every chunk


class ResponseFormat(msgspec.Struct):
    type: Name | None = None


class SamplingBody(msgspec.Struct):
    """Fields both endpoints share."""

    model: Name | None = None
    max_tokens: PositiveInt32 | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX)] | None = None
    # msgspec cannot bound past int64; decode() checks the uint64 ceiling.
    seed: Annotated[int, msgspec.Meta(ge=0)] | None = None
    stop: Text | Annotated[list[Text], msgspec.Meta(max_length=MAX_STOPS)] | None = None
    stop_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_STOPS)] | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=1)] | None = None
    best_of: Annotated[int, msgspec.Meta(ge=1, le=1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Penalty | None = None
    response_format: ResponseFormat | None = None
    # Refused unless neutral; kept undecoded (params.UNSUPPORTED).
    echo: msgspec.Raw = msgspec.Raw(b"null")
    suffix: msgspec.Raw = msgspec.Raw(b"null")
    logprobs: msgspec.Raw = msgspec.Raw(b"null")
    top_logprobs: msgspec.Raw = msgspec.Raw(b"null")
    tools: msgspec.Raw = msgspec.Raw(b"null")
    functions: msgspec.Raw = msgspec.Raw(b"null")
    logit_bias: msgspec.Raw = msgspec.Raw(b"null")


class CompletionBody(SamplingBody):
    # A string, token ids, or a batch of one of either (checked in params).
    prompt: Text | Annotated[list[Text | TokenId | TokenIds], msgspec.Meta(max_length=MAX_ITEMS)] | None = (
        None
    )


class ContentPart(msgspec.Struct):
    type: Name
    text: Text | None = None


class Message(msgspec.Struct):
    role: Name
    # Required and non-null: a message without content is refused, not served as "".
    content: Text | Annotated[list[ContentPart], msgspec.Meta(max_length=MAX_MESSAGES)]


class ChatBody(SamplingBody):
    messages: Annotated[list[Message], msgspec.Meta(min_length=1, max_length=MAX_MESSAGES)] | None = None
    max_completion_tokens: PositiveInt32 | None = None


class TokenIdsCompletionBody(SamplingBody, kw_only=True):
    """A completion whose prompt is one non-empty list of token ids: the form a tokenizing
    client sends, whose ids msgspec's decoder checks in C (`decode_token_ids`)."""

    prompt: Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_ITEMS)]


_DECODERS = {cls: msgspec.json.Decoder(cls) for cls in (CompletionBody, ChatBody)}
_TOKEN_IDS_DECODER = msgspec.json.Decoder(TokenIdsCompletionBody)
_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # \uD800-\uDFFF, paired or not

B = TypeVar("B", CompletionBody, ChatBody)


def decode(raw: bytes, cls: type[B]) -> B:
    """The body as `cls`, or a 400 naming the first field that breaks the schema."""
    try:
        body = _DECODERS[cls].decode(raw)
    except msgspec.ValidationError as e:
        raise _validation_error(str(e)) from None
    except msgspec.DecodeError as e:
        hint = ""
        if _SURROGATE.search(raw):  # msgspec refuses unpaired \uD800-\uDFFF escapes (no UTF-8 for them)
            hint = " (a string holds a \\uD800-\\uDFFF escape outside a valid surrogate pair)"
        raise bad_request(f"the request body is not valid JSON: {e}{hint}") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    if body.seed is not None and body.seed > UINT64_MAX:
        raise bad_request(f"seed: {RULES['seed']}", "seed")
    return body


def decode_token_ids(raw: bytes) -> TokenIdsCompletionBody | None:
    """The body when its prompt is a list of token ids and it is otherwise valid; None for
    anything else (`decode(raw, CompletionBody)` then says what is wrong, or takes it)."""
    try:
        body = _TOKEN_IDS_DECODER.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None
    if body.seed is not None and body.seed > UINT64_MAX:
        return None
    return body


def _validation_error(text: str):
    m = _PATH.search(text)
    if m is None:  # the top level: not an object
        if "Expected `object`" in text:
            return bad_request("the request body must be a JSON object")
        return bad_request(f"the request body is invalid: {text}")
    path = m.group("path").lstrip(".")
    detail = text[: m.start()]
    if path.startswith("messages") and "Object missing required field `content`" in detail:
        path, detail = path + ".content", "is required"
    top = re.split(r"[.\[]", path, maxsplit=1)[0]
    if top in RULES and "Object missing" not in detail:
        return bad_request(f"{path}: {RULES[top]}", path)
    if detail.startswith("Expected `str | array`, got `null`") and path.endswith("content"):
        detail = "must be a string or a list of text parts, not null"
    return bad_request(f"{path}: {detail}", path or None)
