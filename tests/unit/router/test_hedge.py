"""The hedge decision core: when to hedge, and which attempt of a race to keep."""

from __future__ import annotations

import pytest

from services.router.hedge import HedgeConfig, Leg, Winner, hedge_delay, race_winner

ON = HedgeConfig(enabled=True, multiple=3.0, min_delay_s=0.05, max_hedges=1)


def test_hedging_is_off_by_default():
    assert hedge_delay(HedgeConfig(), 0.1) is None


def test_the_delay_is_a_multiple_of_the_predicted_ttft_with_a_floor():
    assert hedge_delay(ON, 0.1) == pytest.approx(0.3)
    assert hedge_delay(ON, 0.001) == pytest.approx(0.05)


def test_no_prediction_or_no_hedges_left_means_no_hedge():
    assert hedge_delay(ON, None) is None
    assert hedge_delay(ON, 0.1, hedges_so_far=1) is None
    assert hedge_delay(HedgeConfig(enabled=True, max_hedges=2), 0.1, hedges_so_far=1) is not None


@pytest.mark.parametrize(
    ("primary", "hedge", "want"),
    [
        (Leg.WAITING, Leg.WAITING, Winner.NONE),
        (Leg.STARTED, Leg.WAITING, Winner.PRIMARY),
        (Leg.WAITING, Leg.STARTED, Winner.HEDGE),
        (Leg.STARTED, Leg.STARTED, Winner.PRIMARY),  # a tie: the better-ranked worker
        (Leg.FAILED, Leg.WAITING, Winner.HEDGE),  # the hedge goes on alone
        (Leg.WAITING, Leg.FAILED, Winner.PRIMARY),
        (Leg.FAILED, Leg.FAILED, Winner.PRIMARY),  # its error goes to recovery
        (Leg.FAILED, Leg.STARTED, Winner.HEDGE),
        (Leg.STARTED, Leg.FAILED, Winner.PRIMARY),
    ],
)
def test_race_winner(primary, hedge, want):
    assert race_winner(primary, hedge) is want
    assert race_winner(primary, hedge, tied=True) is want  # messages and failures decide alike


@pytest.mark.parametrize(
    ("primary", "hedge", "untied", "tied"),
    [
        # untied, a leg computing is still waiting for its first message
        (Leg.COMPUTING, Leg.WAITING, Winner.NONE, Winner.PRIMARY),
        (Leg.WAITING, Leg.COMPUTING, Winner.NONE, Winner.HEDGE),  # the queued primary is cancelled
        (Leg.COMPUTING, Leg.COMPUTING, Winner.NONE, Winner.NONE),  # both computing: first message
        (Leg.COMPUTING, Leg.STARTED, Winner.HEDGE, Winner.HEDGE),
        (Leg.STARTED, Leg.COMPUTING, Winner.PRIMARY, Winner.PRIMARY),
        (Leg.FAILED, Leg.COMPUTING, Winner.HEDGE, Winner.HEDGE),  # the copy goes on alone
        (Leg.COMPUTING, Leg.FAILED, Winner.PRIMARY, Winner.PRIMARY),
    ],
)
def test_a_tied_race_is_won_by_the_first_leg_to_begin_computing(primary, hedge, untied, tied):
    assert race_winner(primary, hedge) is untied
    assert race_winner(primary, hedge, tied=True) is tied


def test_the_config_is_checked():
    with pytest.raises(ValueError):
        HedgeConfig(multiple=0)
    with pytest.raises(ValueError):
        HedgeConfig(max_hedges=-1)


def test_a_copy_is_worth_sending_only_where_it_should_beat_the_primary():
    from services.router.hedge import worth_hedging

    assert worth_hedging(0.6, copy_ttft_s=0.1, copy_wait_s=0.2)  # 0.3 s there vs 0.6 s waited
    assert not worth_hedging(0.6, copy_ttft_s=0.1, copy_wait_s=0.5)  # it would queue as long
    assert not worth_hedging(0.2, copy_ttft_s=0.25, copy_wait_s=0.0)  # slower there even idle
    assert worth_hedging(0.2, copy_ttft_s=None, copy_wait_s=0.0)  # no prediction: its wait decides
