"""Write the local model folder both systems load: a WordLevel tokenizer, no weights.

    python make_model_folder.py OUT_DIR [--vocab-size 32000]

Dynamo's mocker needs a Hugging Face folder (`--model-path`) for its tokenizer
and model card, and cannot reach a hub here; pdmesh's sim workers, router and
gateway take the same folder (`--engine-model-path` / `--model-path`), so both
systems see the same vocabulary, EOS id and context limit. Contents:

- tokenizer.json: `tokenizers` WordLevel model, ids 0..2 are <unk>, <s>, </s>
  (EOS), ids 3.. are the words "w3", "w4", ...; whitespace pre-tokenizer. About
  32,000 entries: a tiny vocabulary makes the mocker's random output ids
  undecodable (empty text; ../shared/peers/dynamo.md).
- config.json: a llama-shaped config (vocab_size, a small made-up geometry; no
  weights are ever loaded: the mocker and pdmesh's sim backend only read it).
- tokenizer_config.json with a trivial chat_template, generation_config.json.

Prompts for the benchmark are token ids in [FIRST_WORD_ID, vocab_size) so none
is a special token. Idempotent: an existing folder with the same files is left
as it is. Needs only `tokenizers` (in both the project's and Dynamo's venv).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SPECIALS = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
FIRST_WORD_ID = len(SPECIALS)
DEFAULT_VOCAB = 32000
MAX_POSITIONS = 131072
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def word(token_id: int) -> str:
    """The word of a non-special id (ids below FIRST_WORD_ID are specials)."""
    return SPECIALS[token_id] if token_id < FIRST_WORD_ID else f"w{token_id}"


def vocab(vocab_size: int) -> dict[str, int]:
    if vocab_size <= FIRST_WORD_ID:
        raise ValueError(f"vocab_size must be > {FIRST_WORD_ID}, got {vocab_size}")
    return {word(i): i for i in range(vocab_size)}


def config_json(vocab_size: int) -> dict:
    """A llama config: only vocab_size, EOS/BOS and the context limit matter to the sim engines."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "bfloat16",
    }


def files(vocab_size: int = DEFAULT_VOCAB) -> dict[str, str]:
    """File name -> text of the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=vocab(vocab_size), unk_token=SPECIALS[UNK_ID]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Words come back separated by spaces (WordPiece's decoder with no "##" continuation).
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(list(SPECIALS))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIALS[BOS_ID],
        "eos_token": SPECIALS[EOS_ID],
        "unk_token": SPECIALS[UNK_ID],
        "add_bos_token": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }
    generation_config = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
    return {
        "tokenizer.json": tok.to_str(),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=1),
        "config.json": json.dumps(config_json(vocab_size), indent=1),
        "generation_config.json": json.dumps(generation_config, indent=1),
    }


def write_folder(out: Path, vocab_size: int = DEFAULT_VOCAB) -> bool:
    """Write the folder; False if it already held exactly these files."""
    out.mkdir(parents=True, exist_ok=True)
    changed = False
    for name, text in files(vocab_size).items():
        path = out / name
        if path.is_file() and path.read_text() == text:
            continue
        path.write_text(text)
        changed = True
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB)
    a = p.parse_args(argv)
    changed = write_folder(a.out, a.vocab_size)
    print(f"model folder {a.out}: {'written' if changed else 'up to date'} (vocab {a.vocab_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
