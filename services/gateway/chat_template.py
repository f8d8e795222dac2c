"""Chat messages -> one prompt: the built-in template, or a model folder's own.

The built-in model has no chat format of its own, so the gateway documents a
plain one (`BUILTIN_TEMPLATE_DOC`): each message is a `<|role|>` line followed by
its content and a newline, and the prompt ends with `<|assistant|>\\n` so the
model continues as the assistant.

A Hugging Face folder brings its own template (`chat_template.jinja`, or
`chat_template` in `tokenizer_config.json`), rendered the way `transformers`
renders it: a sandboxed jinja2 environment with `messages`,
`add_generation_prompt=True`, `bos_token` and `eos_token`. When the folder has
`tokenizer.json` the rendered text is tokenized here without special tokens
(the template already placed them), so the router does not add a second BOS.
A GGUF file brings it in its metadata (`tokenizer.chat_template`), with the
tokenizer rebuilt from the file (services/model/gguf.py).
A folder without a template, or no jinja2, refuses chat with a clear 400.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.gateway.errors import bad_request
from services.model.gguf import is_gguf, read_gguf

BUILTIN_TEMPLATE_DOC = "<|role|>\\ncontent\\n per message, then <|assistant|>\\n"
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat prompt: text for the router to tokenize, or token ids."""

    text: str
    token_ids: tuple[int, ...] | None = None


class BuiltinChatTemplate:
    """The documented template of the built-in model (see BUILTIN_TEMPLATE_DOC)."""

    name = "builtin"

    def render(self, messages: Sequence[dict[str, str]]) -> ChatPrompt:
        lines = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
        return ChatPrompt("".join(lines) + "<|assistant|>\n")


class HfChatTemplate:
    """A Hugging Face jinja chat template, rendered in a jinja2 sandbox."""

    name = "hf"

    def __init__(
        self,
        source: str,
        special: dict[str, str],
        encode: Callable[[str], list[int]] | None = None,
    ):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        self._template = env.from_string(source)
        self._template_error = TemplateError
        self._special = special
        self._encode = encode

    def render(self, messages: Sequence[dict[str, str]]) -> ChatPrompt:
        try:
            text = self._template.render(messages=list(messages), add_generation_prompt=True, **self._special)
        except self._template_error as e:
            raise bad_request(f"messages: the model's chat template refused them: {e}", "messages") from e
        ids = tuple(self._encode(text)) if self._encode is not None else None
        return ChatPrompt(text, ids)


class NoChatTemplate:
    """A model folder without a usable template: chat is refused, completions still work."""

    name = "none"

    def __init__(self, reason: str):
        self.reason = reason

    def render(self, messages: Sequence[dict[str, str]]) -> ChatPrompt:
        raise bad_request(f"chat is not available for this model: {self.reason}", "messages")


ChatTemplate = BuiltinChatTemplate | HfChatTemplate | NoChatTemplate


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def _template_source(folder: Path, config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    return source if isinstance(source, str) and source else None


def _gguf_template(model_path: str) -> ChatTemplate:
    """A GGUF file's `tokenizer.chat_template`, encoded with the tokenizer rebuilt from the file."""
    model = read_gguf(model_path)
    if not model.chat_template:
        return NoChatTemplate(f"{model_path} has no tokenizer.chat_template in its metadata")
    try:
        import jinja2  # noqa: F401
    except ImportError:
        return NoChatTemplate("rendering its chat_template needs jinja2, which is not installed")
    tokenizer = model.build_tokenizer()

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    return HfChatTemplate(model.chat_template, model.special_tokens, encode)


def load_chat_template(model_path: str | None) -> ChatTemplate:
    """The template for the served model: built-in without a folder, else the folder's."""
    if model_path is None:
        return BuiltinChatTemplate()
    if is_gguf(model_path):
        return _gguf_template(model_path)
    folder = Path(model_path)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    source = _template_source(folder, config)
    if source is None:
        return NoChatTemplate(f"{folder} has no chat_template (tokenizer_config.json or chat_template.jinja)")
    try:
        import jinja2  # noqa: F401  (transformers renders templates with it too)
    except ImportError:
        return NoChatTemplate("rendering its chat_template needs jinja2, which is not installed")
    special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    encode = None
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False).ids

    return HfChatTemplate(source, special, encode)
