"""The committed stubs under pdmesh/v1 are exactly what `make proto` generates."""

import filecmp
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_committed_stubs_match_protos(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = tmp_path / "pdmesh" / "v1"
    committed = ROOT / "pdmesh" / "v1"
    fresh_names = sorted(p.name for p in fresh.iterdir() if p.is_file())
    committed_names = sorted(
        p.name for p in committed.iterdir() if p.is_file() and p.suffix in (".py", ".pyi")
    )
    assert fresh_names == committed_names, "stub files differ from the protos: run `make proto`"
    drifted = [n for n in fresh_names if not filecmp.cmp(fresh / n, committed / n, shallow=False)]
    assert drifted == [], f"stale generated stubs {drifted}: run `make proto`"


def test_every_proto_has_stubs():
    protos = sorted(p.stem for p in (ROOT / "protos" / "pdmesh" / "v1").glob("*.proto"))
    for stem in protos:
        assert (ROOT / "pdmesh" / "v1" / f"{stem}_pb2.py").exists(), stem
        assert (ROOT / "pdmesh" / "v1" / f"{stem}_pb2.pyi").exists(), stem
