"""The sim timing model reproduces its coefficient tables."""

import json

import pytest

from services.model.timing import PROFILES_PATH, load_profile, load_profiles


def test_mocker_profile_reproduces_dynamo_worked_values():
    p = load_profile("dynamo-mocker")
    # Worked values from Dynamo's perf model (shared/peers/sim_models.md).
    assert p.prefill_ms(2048) == pytest.approx(49.4, abs=0.1)
    assert p.prefill_ms(8192) == pytest.approx(169.0, abs=0.5)
    assert p.prefill_ms(0) == 0.0
    assert p.decode_ms(1, 0) == pytest.approx(5.74)
    assert p.decode_ms(8, p.capacity_tokens) == pytest.approx(34.01, abs=0.01)
    assert p.decode_ms(8, 10 * p.capacity_tokens) == pytest.approx(34.01, abs=0.01)  # u clamped at 1
    # Llama-3-8B bf16: 4k tokens at 64 GB/s = 8.4 ms.
    assert p.transfer_s(4096) == pytest.approx(8.39e-3, rel=1e-2)


def test_linear_profile_matches_its_table():
    p = load_profile("splitwise-h100-llama70b")
    p0, p1, _, _ = p.prefill
    assert p.prefill_ms(1000) == pytest.approx(p0 + p1 * 1000)
    d0, d1, _ = p.decode
    assert p.decode_ms(16, 5000) == pytest.approx(d0 + d1 * 16)
    assert p.pass_ms(100, 0, 4, 400) == pytest.approx(p.prefill_ms(100) + p.decode_ms(4, 400))


def test_every_profile_cites_its_source_and_bad_tables_are_refused(tmp_path):
    for name, p in load_profiles().items():
        assert p.source, name
    bad = tmp_path / "p.json"
    mocker = json.loads(PROFILES_PATH.read_text())["dynamo-mocker"]
    bad.write_text(json.dumps({"x": {**mocker, "decode_form": "cubic"}}))
    with pytest.raises(ValueError, match="decode_form"):
        load_profiles(bad)
    with pytest.raises(ValueError, match="unknown sim profile"):
        load_profile("nope")


def test_calibrated_cpu_profile_matches_its_table():
    p = load_profile("cpu-small-bfloat16")  # written by bench/calibrate.py
    assert "bench/calibrate.py" in p.source and p.decode_form == "quadratic"
    d0, d1, d2, d3 = p.decode
    k = 5.0
    assert p.decode_ms(8, 5000) == pytest.approx(max(d0 + d1 * 8 + d2 * k + d3 * k * k, p.decode_min_ms))
    p0, p1, p2, p3 = p.prefill
    assert p.prefill_ms(300, 700) == pytest.approx(p0 + p1 * 300 + p2 * 300**2 + p3 * 300 * 0.7)
    assert p.kv_bytes_per_token == 8 * 2 * 4 * 64 * 2  # small preset, bfloat16
