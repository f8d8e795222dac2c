"""Chat templates: the documented built-in one, a model folder's jinja template, and refusal."""

from __future__ import annotations

import json

import pytest

from services.gateway.chat_template import (
    BuiltinChatTemplate,
    HfChatTemplate,
    NoChatTemplate,
    load_chat_template,
)
from services.gateway.errors import GatewayError

# The shape of a Llama-3-style template, small enough to read.
LLAMA_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


def test_builtin_template_is_role_lines_then_the_assistant_prefix():
    prompt = BuiltinChatTemplate().render([{"role": "user", "content": "Hi"}])
    assert prompt.text == "<|user|>\nHi\n<|assistant|>\n" and prompt.token_ids is None


def test_no_folder_means_the_builtin_template():
    assert isinstance(load_chat_template(None), BuiltinChatTemplate)


def test_folder_template_from_tokenizer_config_with_special_tokens(tmp_path):
    cfg = {"chat_template": LLAMA_LIKE, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    template = load_chat_template(str(tmp_path))
    assert isinstance(template, HfChatTemplate)
    prompt = template.render([{"role": "user", "content": "Hi"}])
    assert prompt.text == "<s><|start|>user\nHi<|end|>\n<|start|>assistant\n"
    assert prompt.token_ids is None  # no tokenizer.json: the router tokenizes the text


def test_chat_template_jinja_file_wins_and_named_templates_pick_default(tmp_path):
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert load_chat_template(str(tmp_path)).render([]).text == "DEFAULT"
    (tmp_path / "chat_template.jinja").write_text("FILE")
    assert load_chat_template(str(tmp_path)).render([]).text == "FILE"


def test_folder_with_tokenizer_json_tokenizes_without_special_tokens(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"[BOS]": 0, "hi": 1, "<|start|>": 2, "x": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="x"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "hi hi"}))
    prompt = load_chat_template(str(tmp_path)).render([{"role": "user", "content": "q"}])
    assert prompt.token_ids == (1, 1)  # no [BOS] from the post-processor: the template owns specials


def test_template_raise_exception_is_a_400(tmp_path):
    src = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": src}))
    template = load_chat_template(str(tmp_path))
    assert template.render([{"role": "user", "content": "x"}]).text == "ok"
    with pytest.raises(GatewayError) as info:
        template.render([{"role": "system", "content": "x"}])
    assert info.value.status == 400 and "first must be user" in info.value.message


def test_templates_cannot_reach_python_internals(tmp_path):
    src = "{{ messages.__class__.__mro__ }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": src}))
    with pytest.raises(GatewayError) as info:
        load_chat_template(str(tmp_path)).render([])
    assert info.value.status == 400 and "unsafe" in info.value.message


def test_folder_without_template_refuses_chat_clearly(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    template = load_chat_template(str(tmp_path))
    assert isinstance(template, NoChatTemplate)
    with pytest.raises(GatewayError) as info:
        template.render([{"role": "user", "content": "x"}])
    assert info.value.status == 400 and "chat_template" in info.value.message
