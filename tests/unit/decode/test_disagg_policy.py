import pytest

from services.common.config import ConfigError
from services.decode.disagg_policy import (
    Candidate,
    DisaggConfig,
    DisaggregationPolicy,
    Mode,
    Path,
    Reason,
)

P = DisaggregationPolicy(DisaggConfig(max_local_prefill_tokens=100))
C = [Candidate("p1", "a:1", estimated_wait_s=0.1)]


def test_short_uncached_prompt_stays_local():
    d = P.decide(prompt_tokens=100, cached_tokens=0, candidates=C, local_wait_s=0)
    assert (d.path, d.reason, d.candidate) == (Path.LOCAL, Reason.SHORT_PROMPT, None)


def test_long_prompt_goes_remote_to_the_best_healthy_candidate():
    cands = [Candidate("p0", "a:0", healthy=False), *C]
    d = P.decide(prompt_tokens=101, cached_tokens=0, candidates=cands, local_wait_s=1.0)
    assert (d.path, d.reason) == (Path.REMOTE, Reason.LONG_PROMPT)
    assert d.candidate.worker_id == "p1"
    assert d.label == "remote/long_prompt"


def test_cached_prefix_counts_against_the_threshold():
    d = P.decide(prompt_tokens=1000, cached_tokens=950, candidates=C, local_wait_s=1.0)
    assert d.reason is Reason.SHORT_PROMPT


def test_no_healthy_candidate_means_local():
    d = P.decide(1000, 0, [Candidate("p", "a", healthy=False)], local_wait_s=0)
    assert (d.path, d.reason) == (Path.LOCAL, Reason.NO_CANDIDATE)
    assert P.decide(1000, 0, [], 0).reason is Reason.NO_CANDIDATE


def test_busy_prefill_worker_means_local():
    d = P.decide(1000, 0, [Candidate("p", "a", estimated_wait_s=2.0)], local_wait_s=0.5)
    assert (d.path, d.reason) == (Path.LOCAL, Reason.PREFILL_BUSY)
    margin = DisaggregationPolicy(DisaggConfig(max_local_prefill_tokens=100, busy_margin_s=2.0))
    assert margin.decide(1000, 0, [Candidate("p", "a", estimated_wait_s=2.0)], 0.5).path is Path.REMOTE


def test_a_busy_prefill_worker_still_gets_prompts_too_long_to_prefill_here():
    policy = DisaggregationPolicy(DisaggConfig(max_local_prefill_tokens=100, max_busy_local_prefill_s=0.5))
    busy = [Candidate("p", "a", estimated_wait_s=2.0)]
    # At 1,000 tokens/s this worker prefills 500 tokens in the allowed 0.5 s, not 501.
    assert policy.decide(500, 0, busy, 0, Mode.AUTO, local_tokens_per_s=1000).reason is Reason.PREFILL_BUSY
    d = policy.decide(501, 0, busy, 0, Mode.AUTO, local_tokens_per_s=1000)
    assert (d.path, d.reason) == (Path.REMOTE, Reason.LONG_PROMPT)
    assert policy.decide(900, 400, busy, 0, Mode.AUTO, 1000).reason is Reason.PREFILL_BUSY  # uncached 500
    # A 20x faster worker takes the same prompt and more within the same time.
    assert policy.decide(10_000, 0, busy, 0, Mode.AUTO, local_tokens_per_s=20_000).path is Path.LOCAL


def test_forced_modes():
    assert P.decide(10, 0, C, 0, Mode.LOCAL).reason is Reason.FORCED_LOCAL
    d = P.decide(10, 0, C, 0, Mode.REMOTE)
    assert (d.path, d.reason) == (Path.REMOTE, Reason.FORCED_REMOTE)
    # Forced remote ignores the wait estimate but still needs a candidate.
    assert P.decide(10, 0, [Candidate("p", "a", estimated_wait_s=9)], 0, Mode.REMOTE).path is Path.REMOTE
    assert P.decide(10, 0, [], 0, Mode.REMOTE).reason is Reason.NO_CANDIDATE


def test_config_validation():
    with pytest.raises(ConfigError):
        DisaggConfig(max_local_prefill_tokens=-1)
    with pytest.raises(ConfigError, match="max_busy_local"):
        DisaggConfig(max_busy_local_prefill_s=-1)


def test_default_mode_must_be_known():
    assert DisaggConfig(default_mode="remote").default_mode == "remote"
    with pytest.raises(ConfigError, match="default_mode"):
        DisaggConfig(default_mode="sometimes")
