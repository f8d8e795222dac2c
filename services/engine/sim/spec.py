"""sim_spec: what an EngineConfig with backend "sim" resolves to.

Like `EngineSpec.resolve`, but the KV pool is a tiny real one (1 layer, 1 KV
head, head_dim 1, float16: 4 bytes per token) so NIXL / gRPC transports still
register and move real bytes, and its size is the *modeled* engine's: what
wins, per setting:

- num_blocks: EngineConfig.num_blocks when set, else the profile's (a GPU's
  pool, e.g. 16,384 blocks for dynamo-mocker);
- block_size, max_num_seqs, max_num_batched_tokens: always EngineConfig's
  (they have no "unset"; block_size must match the router's). Pass the
  profile's values as flags to reproduce its deployment, as bench/routing does;
- max_model_len: EngineConfig.max_model_len when set, else the pool's capacity
  (the preset's position limit does not apply: no model runs).

The preset / model folder gives only the tokenizer, vocabulary and EOS ids.
"""

from __future__ import annotations

from kvtransfer.layout import KvLayout
from services.engine.api import EngineCapabilities, EngineInfo, Tokenizer
from services.engine.config import EngineConfig
from services.engine.engine_spec import EngineSpec
from services.model.model_config import ModelConfig
from services.model.timing import TimingProfile
from services.model.tokenizer import ByteTokenizer, HfTokenizer

# One float16 per K and per V per token: 2 * 2 bytes.
SIM_LAYOUT_FIELDS = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "float16"}


def sim_spec(config: EngineConfig, profile: TimingProfile) -> EngineSpec:
    if config.model_path is not None:
        model = ModelConfig.from_hf_folder(config.model_path)
        tokenizer: Tokenizer = HfTokenizer(config.model_path, model.vocab_size, model.eos_token_ids)
    else:
        model = ModelConfig.from_preset(config.preset)
        tokenizer = ByteTokenizer()
    layout = KvLayout(block_size=config.block_size, **SIM_LAYOUT_FIELDS)
    num_blocks = config.num_blocks if config.num_blocks is not None else profile.num_blocks
    capacity = num_blocks * config.block_size
    max_len = min(config.max_model_len or capacity, capacity)
    info = EngineInfo(
        backend="sim",
        model_id=config.resolved_model_id,
        vocab_size=model.vocab_size,
        max_model_len=max_len,
        block_size=config.block_size,
        num_blocks=num_blocks,
        layout=layout,
        eos_token_ids=model.eos_token_ids or tuple(tokenizer.eos_token_ids),
        device="cpu",
        capabilities=EngineCapabilities(moves_kv_itself=False, exports_kv_pool=True),
    )
    return EngineSpec(config, model, tokenizer, layout, num_blocks, max_len, info)
