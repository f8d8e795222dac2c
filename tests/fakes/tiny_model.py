"""A tiny random-weight Llama saved as a Hugging Face folder (config, safetensors, tokenizer.json).

vocab 512, hidden 64, 2 layers, 4 heads, 2 KV heads: it saves and loads in well
under a second, and both pdmesh's torch engine (under the fake TensorRT-LLM) and
real TensorRT-LLM can load it.
"""

from __future__ import annotations

from pathlib import Path

SIZES = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def make_tiny_llama(folder: Path, seed: int = 1234) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**SIZES)).eval()
    with torch.no_grad():  # peaked logits: greedy ties are unlikely
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    vocab = {"<s>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, SIZES["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    return folder
