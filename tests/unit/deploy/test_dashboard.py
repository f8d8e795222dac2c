"""deploy/grafana/pdmesh.json is a well-formed Grafana dashboard over the topics the
issue asks for. That every metric it queries is really exposed is checked against
live /metrics pages in tests/e2e/test_compose_launch.py."""

from __future__ import annotations

import json
import re

from tests.unit.deploy import repo

DASHBOARD = repo.ROOT / "deploy" / "grafana" / "pdmesh.json"


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_panels_have_unique_ids_queries_and_the_datasource_variable():
    doc = load()
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    assert any(v["name"] == "datasource" and v["type"] == "datasource" for v in doc["templating"]["list"])
    for panel in doc["panels"]:
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for t in panel["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]


def test_panels_do_not_overlap():
    cells = set()
    for p in load()["panels"]:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, p["title"]
        cells |= mine


def test_covers_what_operators_asked_for():
    exprs = " ".join(t["expr"] for p in load()["panels"] for t in p["targets"])
    for metric in (
        "pdmesh_router_ttft_seconds_bucket",  # TTFT
        "pdmesh_router_itl_seconds_bucket",  # ITL
        "pdmesh_decode_itl_seconds_bucket",
        "pdmesh_router_queued",  # queue depth: admission, engines, each worker
        "pdmesh_engine_waiting",
        "pdmesh_router_worker_waiting",
        "pdmesh_kv_blocks_used",  # KV blocks used / free
        "pdmesh_kv_blocks_free",
        "pdmesh_disagg_decisions_total",  # disaggregation decisions
        "pdmesh_kv_transfers_total",  # transfers
        "pdmesh_router_workers",  # breaker state (health="breaker_open")
        "pdmesh_router_breaker_state",  # breaker state per worker
        "pdmesh_router_shed_total",  # sheds
        "pdmesh_router_migrations_total",  # migrations
        "pdmesh_tokens_per_successful_request",  # cost per successful request
    ):
        assert re.search(rf"\b{metric}\b", exprs), metric
