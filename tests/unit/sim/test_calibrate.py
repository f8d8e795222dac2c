"""bench/calibrate.py's fit and profile writer (the measurement itself is the benchmark)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.calibrate import fit_decode, fit_prefill, write_profile
from services.model.timing import PROFILES_PATH, load_profiles


def test_fit_recovers_the_coefficients_of_exact_data():
    p = (4.0, 0.6, 2e-4, 0.7)
    prefill = [
        (t, c, p[0] + p[1] * t + p[2] * t * t + p[3] * t * c / 1000)
        for t in (16, 128, 1024)
        for c in (0, 512)
    ]
    coef, _, r2 = fit_prefill(prefill)
    assert coef == pytest.approx(p, rel=1e-6) and r2 == pytest.approx(1.0)
    d = (10.0, 0.4, 0.7, 0.25)
    decode = [
        (b, k, d[0] + d[1] * b + d[2] * k / 1000 + d[3] * (k / 1000) ** 2)
        for b in (1, 8, 32)
        for k in (b * 64.0, b * 700.0)
    ]
    coef, _, r2 = fit_decode(decode)
    assert coef == pytest.approx(d, rel=1e-6) and r2 == pytest.approx(1.0)


def test_fit_keeps_every_coefficient_non_negative():
    # Data falling with B: plain least squares would give a negative B coefficient.
    decode = [(b, 100.0 * b, 50.0 - b) for b in (1, 2, 4, 8, 16)]
    coef, _, _ = fit_decode(decode)
    assert (coef >= 0).all()
    assert coef[1] == 0.0


def test_write_profile_adds_a_readable_profile_and_keeps_the_others(tmp_path):
    path = tmp_path / "profiles.json"
    path.write_text(PROFILES_PATH.read_text())
    table = {**json.loads(PROFILES_PATH.read_text())["splitwise-h100-llama70b"], "source": "test"}
    table |= {"decode_form": "quadratic", "decode": [1.0, 2.0, 3.0, 4.0], "decode_min_ms": 0.0}
    write_profile("cpu-test", table, path)
    profiles = load_profiles(path)
    assert set(profiles) == set(load_profiles()) | {"cpu-test"}
    assert profiles["cpu-test"].decode_ms(2, 1000) == pytest.approx(1 + 4 + 3 + 4)
    assert np.isclose(
        profiles["dynamo-mocker"].prefill_ms(2048), load_profiles()["dynamo-mocker"].prefill_ms(2048)
    )
