"""OpenAI request bodies -> GenerationPlan: what is accepted, mapped, and refused with a 400."""

from __future__ import annotations

import pytest

from pdmesh.v1 import router_pb2
from services.gateway.chat_template import BuiltinChatTemplate
from services.gateway.errors import GatewayError
from services.gateway.params import parse_chat, parse_completion, parse_json

MODEL = "builtin-tiny"


def refused(fn, *args) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        fn(*args)
    assert info.value.status == 400
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


def test_unknown_model_is_a_400_naming_the_served_one():
    err = refused(parse_completion, {"model": "gpt-4", "prompt": "x"}, MODEL)
    assert err.code == "model_not_found" and MODEL in err.message


def test_malformed_json_and_non_objects_are_400s():
    refused(parse_json, b"{not json")
    refused(parse_json, b"[1, 2]")
    refused(parse_json, b"\xff\xfe")
    assert parse_json(b'{"a": 1}') == {"a": 1}


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
