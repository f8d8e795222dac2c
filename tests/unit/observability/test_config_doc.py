"""docs/CONFIG.md is generated from the services' config dataclasses and matches
what each service really accepts."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.unit.deploy import repo

DOC = repo.ROOT / "docs" / "CONFIG.md"
SERVICES = {
    "router": "services.router.main",
    "decode": "services.decode.main",
    "prefill": "services.prefill.main",
    "kvtransfer": "services.kvtransfer.main",
    "gateway": "services.gateway.main",
}


def sections() -> dict[str, str]:
    """Service name -> its part of the doc."""
    parts = re.split(r"^## ", DOC.read_text(), flags=re.M)[1:]
    return {p.split("\n", 1)[0].strip(): p for p in parts}


def test_the_doc_is_what_the_generator_makes_now(tmp_path):
    out = tmp_path / "CONFIG.md"
    subprocess.run(
        [sys.executable, str(repo.ROOT / "scripts" / "gen_config_doc.py"), str(out)],
        cwd=repo.ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert out.read_text() == DOC.read_text(), "docs/CONFIG.md is stale: run python scripts/gen_config_doc.py"


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_option_of_the_real_help_is_documented_under_its_service(service):
    env = {**os.environ, "COLUMNS": "1000"}  # one option per line, nothing wrapped
    text = subprocess.run(
        [sys.executable, "-m", SERVICES[service], "--help"],
        cwd=repo.ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    options = set(re.findall(r"^\s+(--[a-z0-9-]+)", text, flags=re.M)) - {"--help"}
    env_vars = set(re.findall(r"\bPDMESH_[A-Z0-9_]+", text))
    assert len(options) == len(env_vars) > 10
    section = sections()[service]
    documented = set(re.findall(r"^\| `(--[a-z0-9-]+)` \| `(PDMESH_[A-Z0-9_]+)` \|", section, flags=re.M))
    assert {flag for flag, _ in documented} == options
    assert {var for _, var in documented} == env_vars
    if service != "gateway":  # every gRPC service can be traced
        assert ("--otlp-endpoint", "PDMESH_OTLP_ENDPOINT") in documented


def test_the_readme_links_the_reference():
    assert "docs/CONFIG.md" in (repo.ROOT / "README.md").read_text()
