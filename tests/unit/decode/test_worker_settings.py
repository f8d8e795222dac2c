"""Decode and prefill settings are typed dataclasses built from flags and
`PDMESH_*` variables, one field per config section (no `dict[type, object]`)."""

from __future__ import annotations

import dataclasses

import pytest

from services.common.config import ConfigError
from services.decode import main as decode_main
from services.decode.config import DecodeSettings
from services.decode.config import parse_settings as parse_decode
from services.prefill import main as prefill_main
from services.prefill.config import PrefillSettings
from services.prefill.config import parse_settings as parse_prefill


def test_decode_settings_come_from_flags_then_environment():
    s = parse_decode(
        ["--prefill-workers", "a:1,b:2", "--engine-preset", "small", "--limits-max-tokens-limit", "64"],
        {"PDMESH_KV_LEASE_MS": "5000", "PDMESH_PREFILL_WORKERS": "ignored:9"},
    )
    assert isinstance(s, DecodeSettings)
    assert s.decode.prefill_workers == ("a:1", "b:2") and s.decode.kv_lease_ms == 5000
    assert s.engine.preset == "small" and s.limits.max_tokens_limit == 64
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.decode = s.decode  # type: ignore[misc]


def test_prefill_settings_come_from_flags_then_environment():
    s = parse_prefill(["--lease-ttl-s", "7"], {"PDMESH_LEASE_CHECK_S": "0.5", "PDMESH_KV_TRANSPORT": "grpc"})
    assert isinstance(s, PrefillSettings)
    assert (s.prefill.lease_ttl_s, s.prefill.lease_check_s, s.worker.kv_transport) == (7.0, 0.5, "grpc")


def test_a_bad_value_is_refused_with_the_setting_named():
    with pytest.raises(ConfigError, match="kv_lease_ms"):
        parse_decode([], {"PDMESH_KV_LEASE_MS": "1"})


@pytest.mark.parametrize(
    ("main", "settings"), [(decode_main, DecodeSettings), (prefill_main, PrefillSettings)]
)
def test_every_section_of_the_settings_is_a_documented_flag_section(main, settings):
    section_types = {f.default_factory for f in dataclasses.fields(settings)}  # type: ignore[misc]
    assert section_types == {cls for cls, _ in main.CONFIGS}


def test_the_forward_progress_stall_time_is_a_worker_setting_of_both_roles():
    assert parse_decode([], {}).worker.stall_not_serving_s == 15.0
    assert parse_decode(["--stall-not-serving-s", "2.5"], {}).worker.stall_not_serving_s == 2.5
    assert parse_prefill([], {"PDMESH_STALL_NOT_SERVING_S": "0"}).worker.stall_not_serving_s == 0.0  # off
    with pytest.raises(ConfigError, match="stall_not_serving_s"):
        parse_decode(["--stall-not-serving-s", "-1"], {})


def test_on_time_first_admission_is_an_engine_setting_and_its_count_reaches_the_stats():
    from services.engine.api import EngineStats
    from services.worker.serving import counters_from_stats

    assert parse_decode([], {}).engine.queue_late_after_s == 0.0  # first come, first served
    assert parse_decode(["--engine-queue-late-after-s", "1.5"], {}).engine.queue_late_after_s == 1.5
    with pytest.raises(ConfigError, match="queue_late_after_s"):
        parse_decode(["--engine-queue-late-after-s", "-1"], {})
    s = parse_decode(["--engine-queue-late-after-s", "1", "--engine-queue-late-max-s", "3"], {})
    assert (s.engine.queue_late_after_s, s.engine.queue_late_max_s) == (1.0, 3.0)
    assert parse_decode([], {}).engine.queue_late_max_s == 0.0  # no bound
    with pytest.raises(ConfigError, match="queue_late_max_s"):
        parse_decode(["--engine-queue-late-max-s", "3"], {})  # a bound on nothing
    with pytest.raises(ConfigError, match="queue_late_max_s"):
        parse_decode(["--engine-queue-late-after-s", "2", "--engine-queue-late-max-s", "1"], {})
    counts = dict.fromkeys(
        (f.name for f in dataclasses.fields(EngineStats) if f.default is dataclasses.MISSING), 0
    )
    c = counters_from_stats(
        EngineStats(**counts | {"admitted_ahead": 3, "admitted_overdue": 4, "moved_ahead": 5})
    )
    assert (c.admitted_ahead, c.admitted_overdue, c.moved_ahead) == (3, 4, 5)
