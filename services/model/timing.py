"""Timing models: how long one scheduler pass takes on a given model and hardware.

Used by the `sim` engine (its pass times) and by the planner (what one worker can
do), so it lives in the model layer, below both.

A profile is data (profiles.json, one table per profile; `bench/calibrate.py`
adds one measured from the torch engine here). The sim engine runs the real
scheduler and block manager and, instead of a forward pass, waits for the
pass time this model gives, divided by a speedup factor.

    prefill_ms(T, C) = p0 + p1*T + p2*T^2 + p3*T*C/1000       (0 when T == 0)
    decode_ms  linear: d0 + d1*B + d2*K/1000
               quadratic: d0 + d1*B + d2*K/1000 + d3*(K/1000)^2
               mocker: max(d_min, m0 + m1*u + m2*u^2), u = min(K / capacity, 1)
    pass_ms = prefill_ms + decode_ms                          (no overlap, as Dynamo's mocker)
    transfer_s(tokens) = tokens * kv_bytes_per_token / (kv_bandwidth_gbps * 1e9)
    restore_s(tokens)  = tokens * kv_bytes_per_token / (host_bandwidth_gbps * 1e9)

host_bandwidth_gbps is the host <-> accelerator copy rate the host KV tier
restores at; 25 GB/s unless a profile says otherwise (PCIe Gen4 x16 moves ~25
GB/s a direction in practice, Gen5 x16 ~50; NVIDIA's bandwidthTest).

T: new prompt tokens in the pass; C: context tokens they attend to that were
already cached or computed; B: decoding requests; K: their total context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

PROFILES_PATH = Path(__file__).with_name("profiles.json")
# decode_form -> number of decode coefficients
DECODE_FORMS = {"linear": 3, "quadratic": 4, "mocker": 3}


@dataclass(frozen=True)
class TimingProfile:
    name: str
    source: str
    prefill: tuple[float, float, float, float]
    decode_form: str
    decode: tuple[float, ...]  # 3 coefficients (linear, mocker) or 4 (quadratic)
    decode_min_ms: float
    kv_bytes_per_token: int
    kv_bandwidth_gbps: float
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    host_bandwidth_gbps: float = 25.0

    def __post_init__(self) -> None:
        if self.decode_form not in DECODE_FORMS:
            raise ValueError(
                f"profile {self.name}: decode_form must be one of {sorted(DECODE_FORMS)}, "
                f"got {self.decode_form!r}"
            )
        want = DECODE_FORMS[self.decode_form]
        if len(self.prefill) != 4 or len(self.decode) != want:
            raise ValueError(
                f"profile {self.name}: prefill needs 4 and {self.decode_form} decode {want} coefficients"
            )
        if (
            self.kv_bandwidth_gbps <= 0
            or self.host_bandwidth_gbps <= 0
            or self.num_blocks <= 0
            or self.block_size <= 0
        ):
            raise ValueError(f"profile {self.name}: bandwidth, num_blocks and block_size must be positive")

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def scaled_to(self, num_blocks: int, block_size: int) -> TimingProfile:
        """This profile on a pool of another size (the mocker form's utilisation is of the pool)."""
        return replace(self, num_blocks=num_blocks, block_size=block_size)

    def prefill_ms(self, new_tokens: int, context_tokens: int = 0) -> float:
        if new_tokens <= 0:
            return 0.0
        p0, p1, p2, p3 = self.prefill
        t = float(new_tokens)
        return max(p0 + p1 * t + p2 * t * t + p3 * t * context_tokens / 1000.0, 0.0)

    def decode_ms(self, batch: int, context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        a, b, c, *rest = self.decode
        if self.decode_form in ("linear", "quadratic"):
            k = context_tokens / 1000.0
            value = a + b * batch + c * k + (rest[0] * k * k if rest else 0.0)
        else:
            u = min(context_tokens / self.capacity_tokens, 1.0)
            value = a + b * u + c * u * u
        return max(value, self.decode_min_ms)

    def pass_ms(self, new_tokens: int, context_tokens: int, batch: int, decode_context_tokens: int) -> float:
        return self.prefill_ms(new_tokens, context_tokens) + self.decode_ms(batch, decode_context_tokens)

    def transfer_s(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / (self.kv_bandwidth_gbps * 1e9)

    def restore_s(self, tokens: int) -> float:
        """Copying `tokens` tokens of KV from the host tier into the accelerator's pool."""
        return tokens * self.kv_bytes_per_token / (self.host_bandwidth_gbps * 1e9)


def load_profiles(path: Path = PROFILES_PATH) -> dict[str, TimingProfile]:
    data = json.loads(Path(path).read_text())
    out = {}
    for name, table in data.items():
        if name.startswith("_"):
            continue
        fields = {k: v for k, v in table.items()}
        fields["prefill"] = tuple(fields["prefill"])
        fields["decode"] = tuple(fields["decode"])
        out[name] = TimingProfile(name=name, **fields)
    return out


def load_profile(name: str, path: Path = PROFILES_PATH) -> TimingProfile:
    profiles = load_profiles(path)
    if name not in profiles:
        raise ValueError(f"unknown sim profile {name!r}; one of {sorted(profiles)}")
    return profiles[name]
