"""The planner's table of best P:D splits (issue 19 item 3): what the GPU-regime study
wrote is what the planner reads, and a malformed table is refused with the row named."""

import json
from pathlib import Path

import pytest

from services.planner.split_table import TABLE_PATH, SplitTable, SplitTableError

STUDY = Path(__file__).resolve().parents[3] / "bench" / "results" / "disagg_gpu_splits.json"


def test_the_shipped_table_is_the_study_s_winners():
    table = SplitTable.load()
    study = json.loads(STUDY.read_text())
    assert table.rows and {r.instances for r in table.rows} == {study["instances"]}
    for r in table.rows:
        row = study["best"][r.profile][r.link][r.workload]
        assert f"{r.prefill}:{r.decode}" == row["best_cond_split"]
        assert f"{r.disagg_prefill}:{r.disagg_decode}" == row["best_disagg_split"]
        assert r.goodput_cond == pytest.approx(row["goodput_per_instance"]["cond"])
        # The winner is the best of every split the study swept for that mode.
        cond = (
            {k: v for k, v in row["all_splits"].items() if k.startswith("cond ")}
            if "all_splits" in row
            else {}
        )
        if cond:
            assert r.goodput_cond == pytest.approx(max(cond.values()))
    # Every profile, link and workload of the study has its row.
    want = {(p, ln, w) for p, links in study["best"].items() for ln, ws in links.items() for w in ws}
    assert {(r.profile, r.link, r.workload) for r in table.rows} == want
    assert TABLE_PATH.name == "split_table.json"


def test_a_split_scales_to_another_fleet_at_its_share():
    doc = {
        "instances": 8,
        "best": {
            "p": {
                "l": {
                    "w": {
                        "best_cond_split": "6:2",
                        "best_disagg_split": "5:3",
                        "goodput_per_instance": {"agg": 1, "disagg": 2, "cond": 3},
                    }
                }
            }
        },
    }
    r = SplitTable.from_doc(doc).best("p", "l", "w")
    assert (r.prefill, r.decode, r.disagg_prefill, r.disagg_decode) == (6, 2, 5, 3)
    assert r.prefill_share == 0.75
    assert r.scaled(16) == (12, 4) and r.scaled(4) == (3, 1) and r.scaled(2) == (1, 1)
    with pytest.raises(SplitTableError):
        r.scaled(1)
    with pytest.raises(KeyError):
        SplitTable.from_doc(doc).best("p", "l", "other")
    assert "6:2" in SplitTable.from_doc(doc).render()


@pytest.mark.parametrize(
    ("split", "why"), [("8:0", "not a split of 8"), ("3:3", "not a split of 8"), ("x", "is not P:D")]
)
def test_an_impossible_split_is_refused_with_its_row_named(split, why):
    doc = {
        "instances": 8,
        "best": {
            "p": {
                "l": {
                    "w": {
                        "best_cond_split": split,
                        "best_disagg_split": "4:4",
                        "goodput_per_instance": {"agg": 1, "disagg": 1, "cond": 1},
                    }
                }
            }
        },
    }
    with pytest.raises(SplitTableError, match=f"p/l/w.*{why}"):
        SplitTable.from_doc(doc)
    with pytest.raises(SplitTableError, match="missing"):
        SplitTable.from_doc({"instances": 8, "best": {"p": {"l": {"w": {}}}}})
