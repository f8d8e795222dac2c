"""Sampler, tokenizers, incremental detokenizer and stop checks."""

from __future__ import annotations

import pytest
import torch

from services.engine.api import EngineRequest, FinishReason, SamplingParams
from services.engine.sampler import Sampler, SampleRow, mix_seed
from services.engine.sequence import Sequence
from services.model.tokenizer import ByteTokenizer, HfTokenizer, IncrementalDetokenizer


def logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    x = logits(4)
    assert Sampler()(x, [SampleRow(SamplingParams(), None, 0)] * 4) == x.argmax(-1).tolist()


def test_draw_depends_only_on_seed_and_position():
    sampler = Sampler()
    p = SamplingParams(temperature=1.0)
    x = logits(1)
    alone = [sampler(x, [SampleRow(p, 42, pos)])[0] for pos in range(40)]
    # The same rows inside a batch with other rows, in another order: same draws.
    batch = torch.cat([logits(1, seed=9), x.expand(40, -1)])
    rows = [SampleRow(SamplingParams(), None, 0)] + [SampleRow(p, 42, pos) for pos in range(40)]
    assert sampler(batch, rows)[1:] == alone
    assert len(set(alone)) > 5  # positions draw differently
    assert [sampler(x, [SampleRow(p, 43, pos)])[0] for pos in range(40)] != alone


def test_top_k_and_top_p_restrict_the_support():
    sampler = Sampler()
    x = logits(1, vocab=100)
    top5 = set(x[0].topk(5).indices.tolist())
    k = {sampler(x, [SampleRow(SamplingParams(temperature=2.0, top_k=5), s, 0)])[0] for s in range(200)}
    assert k <= top5 and len(k) > 1
    probs = x[0].softmax(-1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    p = {sampler(x, [SampleRow(SamplingParams(temperature=1.0, top_p=0.5), s, 0)])[0] for s in range(200)}
    assert p <= nucleus
    tiny_p = {
        sampler(x, [SampleRow(SamplingParams(temperature=1.0, top_p=1e-6), s, 0)])[0] for s in range(20)
    }
    assert tiny_p == {int(x.argmax())}


def test_sampling_follows_the_distribution():
    sampler = Sampler()
    x = torch.tensor([[0.0, 1.0, 2.0]])
    draws = [sampler(x, [SampleRow(SamplingParams(temperature=1.0), 7, pos)])[0] for pos in range(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / 3000
    torch.testing.assert_close(freq, x[0].softmax(-1), atol=0.03, rtol=0)


def test_mix_seed_spreads_and_fits_a_generator():
    seeds = {mix_seed(s, p) for s in range(30) for p in range(30)}
    assert len(seeds) == 900 and all(0 <= s < 2**63 for s in seeds)
    torch.Generator().manual_seed(mix_seed(2**64 - 1, 10**9))


def test_byte_tokenizer_roundtrip_and_specials():
    tok = ByteTokenizer()
    ids = tok.encode("héllo 東京")
    assert max(ids) < 256 and tok.decode([tok.bos_token_id, *ids, *tok.eos_token_ids]) == "héllo 東京"


@pytest.mark.parametrize("text", ["plain ascii", "héllo 東京 naïve", "emoji 🙂 split"])
def test_incremental_detokenizer_never_splits_characters(text, tokenizer_json):
    for tok in (ByteTokenizer(), HfTokenizer(tokenizer_json.parent, 512, (1,))):
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.push(t) for t in tok.encode(text)]
        assert "".join(pieces) == text == detok.text
        assert all("\ufffd" not in p for p in pieces)


def test_stop_checks():
    tok = ByteTokenizer()

    def seq(**sp):
        req = EngineRequest("s", [1, 2], SamplingParams(**sp))
        return Sequence(req, 16, None, detokenizer=IncrementalDetokenizer(tok) if sp.get("stop") else None)

    s = seq(max_tokens=3)
    results = []
    for t in (65, 66, 67):
        s.append_token(t)
        results.append(s.check_stop(t, (257,), 100))
    assert results == [None, None, FinishReason.LENGTH]
    s = seq(max_tokens=9)
    s.append_token(257)
    assert s.check_stop(257, (257,), 100) is FinishReason.STOP
    s = seq(max_tokens=9, ignore_eos=True)
    s.append_token(257)
    assert s.check_stop(257, (257,), 100) is None
    s = seq(max_tokens=9, stop=("lo w",))
    reasons = []
    for t in tok.encode("hello world"):
        s.append_token(t)
        reasons.append(s.check_stop(t, (257,), 100))
    assert reasons.index(FinishReason.STOP) == len("hello w") - 1
    s = seq(max_tokens=50)
    s.append_token(70)
    assert s.check_stop(70, (257,), max_model_len=3) is FinishReason.LENGTH
