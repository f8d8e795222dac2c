"""OpenAI request bodies -> GenerationPlan: what is accepted, mapped, and refused with a 400."""

from __future__ import annotations

import json

import pytest

from pdmesh.v1 import router_pb2
from services.gateway import params
from services.gateway.chat_template import BuiltinChatTemplate
from services.gateway.errors import GatewayError

MODEL = "builtin-tiny"


def _raw(body) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def parse_completion(body, served):
    return params.parse_completion(_raw(body), served)


def parse_chat(body, served, template):
    return params.parse_chat(_raw(body), served, template)


def refused(fn, *args, status: int = 400) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        fn(*args)
    assert info.value.status == status
    body = info.value.body()["error"]
    assert body["type"] == "invalid_request_error" and body["message"]
    return info.value


def test_completion_maps_every_supported_field_onto_the_router_request():
    plan = parse_completion(
        {
            "model": MODEL,
            "prompt": "Hello",
            "max_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 42,
            "stop": ["\n", "END"],
            "ignore_eos": True,
            "top_k": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
            "n": 1,
            "user": "ignored",
        },
        MODEL,
    )
    assert plan.stream and plan.include_usage and plan.request_id.startswith("cmpl-")
    req: router_pb2.GenerateRequest = plan.to_proto()
    assert req.text == "Hello" and req.request_id == plan.request_id
    s = req.sampling
    assert (s.max_tokens, s.seed, s.top_k, list(s.stop), s.ignore_eos) == (7, 42, 5, ["\n", "END"], True)
    assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9)


def test_completion_defaults_follow_openai_and_leave_unset_fields_unset():
    req = parse_completion({"prompt": "x"}, MODEL).to_proto()
    assert req.sampling.temperature == 1.0  # OpenAI's default, not greedy
    assert not req.sampling.HasField("max_tokens") and not req.sampling.HasField("seed")
    assert req.sampling.top_p == 0.0  # top_p 1 = off = the proto's unset


def test_completion_accepts_token_ids_and_batches_of_one():
    assert parse_completion({"prompt": [1, 2, 3]}, MODEL).to_proto().token_ids.ids == [1, 2, 3]
    assert parse_completion({"prompt": ["only"]}, MODEL).to_proto().text == "only"
    assert parse_completion({"prompt": [[4, 5]]}, MODEL).to_proto().token_ids.ids == [4, 5]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "logprobs": 2}, "logprobs"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "8"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "temperature": 3}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "stop": 5}, "stop"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "x", "prompt_token_ids": None, "logit_bias": {"1": 5}}, "logit_bias"),
    ],
)
def test_completion_refuses_what_it_cannot_honour(body, param):
    assert refused(parse_completion, body, MODEL).param == param


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": [1, 2], "n": 2}, "n"),
        ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
        ({"prompt": [1, 2], "seed": 2**64}, "seed"),
        ({"prompt": [1, -1]}, "prompt[1]"),
        ({"prompt": [1, True]}, "prompt[1]"),
        ({"prompt": [1, 2.0]}, "prompt[1]"),
        ({"prompt": [1, 2**32]}, "prompt[1]"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
    ],
)
def test_token_id_prompts_are_refused_as_any_other_body(body, param):
    """Token-id prompts are decoded by a schema of their own first (msgspec checks each id
    in C): whatever it does not take goes through the general path, with its errors."""
    assert refused(parse_completion, body, MODEL).param == param


def test_the_token_id_schema_takes_only_plain_token_id_prompts():
    from services.gateway.schema import decode_token_ids

    assert decode_token_ids(json.dumps({"prompt": [5, 0, 7], "max_tokens": 3}).encode()).prompt == [5, 0, 7]
    for body in ({"prompt": "x"}, {"prompt": [[1]]}, {"prompt": []}, {"prompt": [1, True]}, {}):
        assert decode_token_ids(json.dumps(body).encode()) is None, body


def test_unknown_model_is_a_404_naming_the_served_one():
    # OpenAI and vLLM answer 404 (the SDK raises openai.NotFoundError).
    with pytest.raises(GatewayError) as info:
        parse_completion({"model": "gpt-4", "prompt": "x"}, MODEL)
    err = info.value
    assert err.status == 404 and err.type == "not_found_error"
    assert err.code == "model_not_found" and err.param == "model" and MODEL in err.message


def test_malformed_json_and_non_objects_are_400s():
    refused(parse_completion, b"{not json", MODEL)
    refused(parse_completion, b"[1, 2]", MODEL)
    refused(parse_completion, b"\xff\xfe", MODEL)
    assert parse_completion(b'{"prompt": "a"}', MODEL).prompt_text == "a"


def test_chat_renders_messages_and_prefers_max_completion_tokens():
    plan = parse_chat(
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
                },
            ],
            "max_tokens": 3,
            "max_completion_tokens": 9,
        },
        MODEL,
        BuiltinChatTemplate(),
    )
    req = plan.to_proto()
    assert req.text == "<|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\n"
    assert req.sampling.max_tokens == 9 and plan.request_id.startswith("chatcmpl-")


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": 5}],
        ["not an object"],
    ],
)
def test_chat_refuses_malformed_messages(messages):
    refused(parse_chat, {"messages": messages}, MODEL, BuiltinChatTemplate())


def test_chat_refuses_tools_and_json_mode():
    msgs = [{"role": "user", "content": "x"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    refused(parse_chat, {"messages": msgs, "tools": tools}, MODEL, BuiltinChatTemplate())
    refused(
        parse_chat,
        {"messages": msgs, "response_format": {"type": "json_object"}},
        MODEL,
        BuiltinChatTemplate(),
    )
    ok = parse_chat({"messages": msgs, "response_format": {"type": "text"}}, MODEL, BuiltinChatTemplate())
    assert ok.kind == "chat"


# Bodies that reached `to_proto` or `json.loads` unchecked and answered 500 (issue 13 item 5).
HOSTILE = [
    (b'{"prompt": "x", "max_tokens": 2147483648}', "max_tokens"),
    (b'{"prompt": "x", "top_k": 1099511627776}', "top_k"),
    (b'{"prompt": [1, 1099511627776]}', "prompt[1]"),
    (b'{"prompt": "x", "stop_token_ids": [8589934592]}', "stop_token_ids[0]"),
    (b'{"prompt": "x", "seed": 18446744073709551616}', "seed"),
    (b'{"prompt": "\\ud800"}', None),
    (b'{"prompt": "x", "stop": ["\\udfff"]}', None),
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "max_tokens"),
    (b'{"prompt": "x", "extra": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", None),
]


@pytest.mark.parametrize("raw, param", HOSTILE, ids=[f"hostile{i}" for i in range(len(HOSTILE))])
def test_out_of_range_and_malformed_values_are_400s_before_the_proto(raw, param):
    err = refused(parse_completion, raw, MODEL)
    assert err.param == param


def test_limits_in_messages_do_not_contradict_the_router():
    # The router states the serving limit; the gateway must not claim "[1, inf]".
    err = refused(parse_completion, {"prompt": "x", "max_tokens": 0}, MODEL)
    assert "inf" not in err.message and ">= 1" in err.message


@pytest.mark.parametrize(
    "message, param",
    [
        ({"role": "user"}, "messages[0].content"),
        ({"role": "user", "content": None}, "messages[0].content"),
        ({"role": "user", "content": "\udc80"}, None),
    ],
)
def test_chat_message_without_content_or_with_a_lone_surrogate_is_refused(message, param):
    raw = json.dumps({"messages": [message]}).encode()  # json.dumps escapes the surrogate as \udc80
    err = refused(parse_chat, raw, MODEL, BuiltinChatTemplate())
    assert err.param == param


def test_empty_stream_options_without_stream_are_harmless():
    assert not parse_completion({"prompt": "x", "stream_options": {}}, MODEL).stream
    refused(parse_completion, {"prompt": "x", "stream_options": {"include_usage": False}}, MODEL)
