"""bench/gpu_profile.py: its fit, and the measured profile kept in step with its measurements."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.gpu_profile import fit_profile, main, nonneg_lstsq, refit
from services.model.timing import load_profile

ROOT = Path(__file__).resolve().parents[3]
MEASURED = ROOT / "bench/results/gpu_s21/gpu_profile.json"


def test_nonneg_lstsq_drops_a_negative_coefficient_and_refits():
    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    y = np.array([3.0, 2.0, 1.0])  # falling: an unconstrained slope would be -1
    np.testing.assert_allclose(np.linalg.lstsq(a, y, rcond=None)[0], [4.0, -1.0], atol=1e-9)
    np.testing.assert_allclose(nonneg_lstsq(a, y), [2.0, 0.0], atol=1e-9)


def test_fit_recovers_a_profile_it_was_given():
    p0, p1, p2, p3, d0, d1, d2 = 10.0, 0.02, 1e-6, 0.004, 5.0, 0.1, 0.3
    prefill = {t: p0 + p1 * t + p2 * t * t for t in (128, 512, 2048, 8192)}
    ctx = {c: p0 + p1 * 512 + p2 * 512**2 + p3 * 512 * c / 1000 for c in (0, 2048, 6144)}
    decode = {(b, k): d0 + d1 * b + d2 * b * k / 1000 for b in (1, 8, 64) for k in (512, 2048)}
    got = fit_profile(prefill, ctx, 512, decode)
    np.testing.assert_allclose(got["prefill"], [p0, p1, p2, p3], rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(got["decode"], [d0, d1, d2], rtol=1e-3)
    assert got["decode_min_ms"] == pytest.approx(d0 + d1 + d2 * 0.512, rel=1e-3)


def test_the_h200_profile_is_the_fit_of_its_committed_measurements():
    fitted = refit(MEASURED)
    profile = load_profile("pdmesh-torch-h200-llama3-8b")
    assert list(profile.prefill) == fitted["prefill"] and list(profile.decode) == fitted["decode"]
    assert profile.decode_min_ms == fitted["decode_min_ms"]
    assert profile.host_bandwidth_gbps == fitted["host_bandwidth_gbps"]
    assert (profile.num_blocks, profile.kv_bytes_per_token) == (
        fitted["num_blocks"],
        fitted["kv_bytes_per_token"],
    )


def test_the_script_runs_end_to_end_on_cpu(capsys, tmp_path):
    out = tmp_path / "p.json"
    assert (
        main(
            [
                "--shape",
                "tiny",
                "--device",
                "cpu",
                "--quick",
                "--kv-gib",
                "0.02",
                "--no-hf",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("gpu_profile ") and "decode_ms_b32=" in last
    assert refit(out)["decode_form"] == "linear"
