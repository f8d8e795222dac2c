"""Per-worker rates learned online and cold-model charges (services/router/worker_profile.py)."""

from __future__ import annotations

import pytest

from services.router.worker_profile import WorkerProfileConfig, WorkerProfiles


def test_rates_come_from_measurements_not_labels():
    prof = WorkerProfiles()
    # Same label, different measured speed: the prediction follows the measurements.
    prof.register("a", accelerator="cuda/h200", warm_models=("m",))
    prof.register("b", accelerator="cuda/h200", warm_models=("m",))
    prof.observe_prefill("a", 1000, 0.1)
    prof.observe_prefill("b", 1000, 0.4)
    prof.observe_decode("a", 10, 0.1)
    prof.observe_decode("b", 10, 0.3)
    assert prof.predict_s("a", 1000, 10, "m") == pytest.approx(0.2)
    assert prof.predict_s("b", 1000, 10, "m") == pytest.approx(0.7)
    prof.observe_prefill("a", 1000, 0.3)  # slower now: the median of two samples is between
    assert prof.get("a").prefill_s_per_token == pytest.approx(2e-4)
    assert prof.cost_per_token("a", 1000, 10, "m") == pytest.approx((0.2 + 0.1) / 10)


def test_an_unmeasured_worker_gets_the_fleet_median_and_a_cold_model_its_load_time():
    prof = WorkerProfiles(WorkerProfileConfig(default_load_s=30.0))
    for w, s in (("a", 0.1), ("b", 0.2), ("c", 0.6)):
        prof.register(w, warm_models=("m",))
        prof.observe_prefill(w, 100, s)
    prof.register("new", warm_models=("other",), model_load_s=12.0)
    assert prof.predict_s("new", 100, 0, "other") == pytest.approx(0.2)  # the median rate
    assert prof.predict_s("new", 100, 0, "m") == pytest.approx(0.2 + 12.0)  # "m" is cold there
    prof.register("unsaid")  # no load time registered: the default is charged
    assert prof.predict_s("unsaid", 0, 0, "m") == pytest.approx(30.0)
    assert prof.predict_s("unsaid", 0, 0) == 0.0  # no model named: nothing to load


def test_bad_samples_are_ignored_and_rates_survive_re_registration():
    prof = WorkerProfiles()
    prof.register("a")
    prof.observe_prefill("a", 0, 1.0)
    prof.observe_decode("a", 5, 0.0)
    assert prof.get("a").prefill_s_per_token is None and prof.get("a").decode_s_per_token is None
    prof.observe_decode("a", 5, 0.5)
    prof.register("a", memory_headroom_bytes=-3)
    assert prof.get("a").decode_s_per_token == pytest.approx(0.1)
    assert prof.get("a").memory_headroom_bytes == 0
    prof.forget("a")
    assert prof.get("a") is None
    with pytest.raises(ValueError):
        WorkerProfileConfig(window=0)


def test_speed_factors_are_measured_rates_over_the_median_worker():
    prof = WorkerProfiles(WorkerProfileConfig(min_samples=2, max_factor=4.0))
    for w, pre, dec in (("a", 1e-4, 0.01), ("b", 2e-4, 0.02), ("c", 4e-4, 0.2)):
        prof.observe_prefill(w, 100, pre * 100)
        prof.observe_decode(w, 10, dec * 10)
    assert prof.speeds() == {}  # one sample each: not yet
    for w, pre, dec in (("a", 1e-4, 0.01), ("b", 2e-4, 0.02), ("c", 4e-4, 0.2)):
        prof.observe_prefill(w, 100, pre * 100)
        prof.observe_decode(w, 10, dec * 10)
    s = prof.speeds()
    assert s["a"] == pytest.approx((0.5, 0.5))
    assert s["b"] == pytest.approx((1.0, 1.0))
    assert s["c"] == pytest.approx((2.0, 4.0))  # decode 10x the median: capped at max_factor
    assert prof.speeds() is s  # no new sample: the same dict
    prof.observe_decode("d", 10, 1.0)  # a new worker, one sample: not weighed, others unchanged
    assert "d" not in prof.speeds() and prof.speeds()["c"] == pytest.approx((2.0, 4.0))
    prof.forget("b")  # the median moves: between a and c now
    # prefill 1e-4 / 2.5e-4; decode 0.01 / 0.105 is below the floor 1 / max_factor
    assert prof.speeds()["a"] == pytest.approx((0.4, 0.25))


def test_a_worker_measured_in_one_phase_only_is_1_in_the_other():
    prof = WorkerProfiles(WorkerProfileConfig(min_samples=1))
    prof.observe_decode("a", 1, 0.01)
    prof.observe_decode("b", 1, 0.03)
    prof.observe_prefill("a", 10, 0.01)
    s = prof.speeds()
    assert s["a"] == pytest.approx((1.0, 0.5)) and s["b"] == pytest.approx((1.0, 1.5))
    with pytest.raises(ValueError):
        WorkerProfileConfig(min_samples=0)
    with pytest.raises(ValueError):
        WorkerProfileConfig(max_factor=0.5)


def test_a_rate_is_the_median_of_the_newest_samples():
    """One request queued behind a long prompt's chunk must not price a worker at the cap."""
    prof = WorkerProfiles(WorkerProfileConfig(window=5))
    for s in (1.0, 1.1, 0.9, 1.0):
        prof.observe_decode("a", 1, s)
    prof.observe_decode("a", 1, 50.0)  # one stream beside a burst
    assert prof.get("a").decode_s_per_token == pytest.approx(1.0)
    for _ in range(5):  # slower for good: the window turns over
        prof.observe_decode("a", 1, 3.0)
    assert prof.get("a").decode_s_per_token == pytest.approx(3.0)
    assert len(prof.get("a").decode_window) == 5


def test_the_route_mode_is_one_of_three():
    assert WorkerProfileConfig().route == "auto"
    with pytest.raises(ValueError):
        WorkerProfileConfig(route="maybe")


def test_ranking_weighs_the_decode_term_by_the_prefill_factor_unless_told():
    """A slow worker given less work streams faster: its decode factor follows its load."""
    for decode_factor, want in ((False, (1.6, 1.6)), (True, (1.6, 0.4))):
        prof = WorkerProfiles(WorkerProfileConfig(min_samples=1, decode_factor=decode_factor))
        for w, pre, dec in (("slow", 4e-4, 0.01), ("fast", 1e-4, 0.04)):
            prof.observe_prefill(w, 100, pre * 100)
            prof.observe_decode(w, 1, dec)
        # medians of two: prefill 2.5e-4 (slow 1.6x), decode 0.025 (slow 0.4x)
        assert prof.ranking_factors()["slow"] == pytest.approx(want)
        assert prof.speeds()["slow"] == pytest.approx((1.6, 0.4))  # shown as measured either way
