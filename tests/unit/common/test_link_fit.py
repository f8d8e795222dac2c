"""The measured KV link (services/common/wait_estimator.py LinkFit, PathRates.link_ms) and the
puller's check against it (services/decode/prefix_pull.py)."""

from __future__ import annotations

import pytest

from services.common.wait_estimator import LinkFit, PathRates
from services.decode.prefix_pull import PrefixPullFailed, _check_worth_it

KB49 = 49_152


def test_a_slow_first_connection_is_not_the_link():
    # NIXL here: the first 49 KB pull took 70 ms with its connection's setup, the next ones ~5 ms.
    link = LinkFit()
    for seconds in (0.070, 0.005, 0.0052, 0.0049):
        link.update(KB49, seconds)
    assert link.predict_s(KB49) == pytest.approx(0.0052, rel=0.05)


def test_fixed_and_per_byte_parts_are_told_apart_when_sizes_differ():
    link = LinkFit()
    for nbytes in (1e6, 4e6, 16e6, 64e6, 2e6, 32e6):
        link.update(nbytes, 0.005 + nbytes / 5e9)  # 5 ms a transfer, 5 GB/s
    latency, per_byte = link.fit()
    assert latency == pytest.approx(0.005, rel=1e-6) and per_byte == pytest.approx(1 / 5e9, rel=1e-6)
    # bytes over seconds of the small transfers would have priced 64 MB at ~0.33 s, not 0.018
    assert link.predict_s(64e6) == pytest.approx(0.005 + 64e6 / 5e9)


def test_a_link_with_no_fixed_part_is_its_bandwidth():
    link = LinkFit()  # the disaggregation study's sim moves bytes at the profile's bandwidth only
    for nbytes in (3e6, 9e6, 1e6):
        link.update(nbytes, nbytes / 64e9)
    assert link.fit() == pytest.approx((0.0, 1 / 64e9))
    assert LinkFit().fit() == (0.0, 0.0)


def test_the_load_report_waits_for_three_transfers():
    rates = PathRates()
    assert rates.link_ms(16) == (0.0, 0.0)
    rates.pulled(KB49, 0.070, 96)  # 512 B a token, 16 tokens a block
    rates.pulled(KB49, 0.005, 96)
    assert rates.link_ms(16) == (0.0, 0.0)
    rates.pulled(KB49, 0.005, 96)
    latency_ms, per_block_ms = rates.link_ms(16)
    assert latency_ms == 0.0 and per_block_ms == pytest.approx(5.0 / 6)  # 6 blocks in 5 ms


def test_the_puller_trusts_the_router_until_it_measured_three_transfers():
    rates = PathRates(prior_tokens_per_s=100_000.0)
    rates.local_rate.update(100_000.0)  # recomputing 96 tokens here: ~1 ms
    rates.pulled(KB49, 0.070, 96)  # the first connection: 70 ms
    _check_worth_it(rates, 96)  # one transfer is not the link: the pull goes ahead
    rates.pulled(KB49, 0.060, 96)
    rates.pulled(KB49, 0.065, 96)
    with pytest.raises(PrefixPullFailed):  # three slow ones are: skipped
        _check_worth_it(rates, 96)
