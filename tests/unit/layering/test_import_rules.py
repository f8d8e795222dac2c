"""The import rules (scripts/import_rules.py, drawn in docs/DESIGN.md "Layers") hold
for the repository, and the checker catches each kind of forbidden import on a
small fixture tree: the ones services/common and pdmesh/ had before the
worker framework and the API-key format moved."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scripts.import_rules import EXCEPTIONS, check, part_of

ROOT = Path(__file__).resolve().parents[3]


def test_the_repository_keeps_the_import_rules():
    found = check(ROOT)
    assert not found, "forbidden imports (see docs/DESIGN.md 'Layers'):\n" + "\n".join(map(str, found))


def test_the_script_reports_nothing_and_exits_0_on_the_repository():
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "import_rules.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (run.returncode, run.stdout) == (0, "")


def test_every_package_of_the_tree_is_in_the_table():
    for folder in ("services", "kvtransfer", "pdmesh", "bench"):
        for init in (ROOT / folder).rglob("__init__.py"):
            module = ".".join(init.parent.relative_to(ROOT).parts)
            assert part_of(module) is not None, module


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for folder in ("services", "kvtransfer", "pdmesh", "bench"):
        (root / folder).mkdir(exist_ok=True)


def _found(tmp_path: Path) -> set[tuple[str, int, str]]:
    return {(v.path, v.line, v.imported) for v in check(tmp_path, exceptions={})}


# Each forbidden import services/common and pdmesh/ had (issue 14, item 1), in the
# form it had: module level, TYPE_CHECKING-only, inside a function.
BEFORE = {
    "services/common/errors.py": """\
        import grpc
        from kvtransfer.errors import KvTransferFailed
        from kvtransfer.layout import LayoutMismatch
        from services.engine.api import EngineCapacityError
        """,
    "services/common/validation.py": """\
        from pdmesh.v1 import common_pb2
        from services.common.config import require
        from services.engine.api import SamplingParams
        """,
    "services/common/metrics.py": """\
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from services.engine.api import EngineStats
        """,
    "services/common/worker_runtime.py": """\
        from kvtransfer.factory import create_transport
        from services.common.config import setting


        def make():
            from services.engine.factory import create_engine

            return create_engine
        """,
    "pdmesh/security_commands.py": """\
        from pdmesh.cli import command


        def keys():
            from services.router.auth import hash_key

            return hash_key
        """,
    "services/router/config.py": """\
        from services.model.tokenizer import Tokenizer
        from services.engine.model_config import read
        """,
}


def test_the_checker_names_file_and_line_of_each_forbidden_import(tmp_path):
    _tree(tmp_path, BEFORE)
    assert _found(tmp_path) == {
        ("services/common/errors.py", 2, "kvtransfer.errors.KvTransferFailed"),
        ("services/common/errors.py", 3, "kvtransfer.layout.LayoutMismatch"),
        ("services/common/errors.py", 4, "services.engine.api.EngineCapacityError"),
        ("services/common/validation.py", 3, "services.engine.api.SamplingParams"),
        ("services/common/metrics.py", 4, "services.engine.api.EngineStats"),
        ("services/common/worker_runtime.py", 1, "kvtransfer.factory.create_transport"),
        ("services/common/worker_runtime.py", 6, "services.engine.factory.create_engine"),
        ("pdmesh/security_commands.py", 5, "services.router.auth.hash_key"),
        ("services/router/config.py", 2, "services.engine.model_config.read"),
    }
    (v,) = [v for v in check(tmp_path, exceptions={}) if v.path == "pdmesh/security_commands.py"]
    assert str(v) == (
        "pdmesh/security_commands.py:5: pdmesh may not import services.router (module services.router.auth.hash_key)"
    )


def test_the_moved_layout_passes(tmp_path):
    _tree(
        tmp_path,
        {
            "services/common/errors.py": "import grpc\nimport structlog\n",
            "services/common/api_keys.py": "import hashlib\n",
            "services/model/tokenizer.py": "from services.common.config import require\n",
            "services/worker/runtime.py": "from kvtransfer.factory import create_transport\n"
            "from services.engine.factory import create_engine\nfrom services.common.server import run\n",
            "services/engine/api.py": "from kvtransfer.layout import KvLayout\nfrom services.model import hashing\n",
            "services/decode/main.py": "from services.worker.runtime import WorkerRuntime\n"
            "from services.engine.config import EngineConfig\n",
            "services/router/config.py": "from services.model.tokenizer import Tokenizer\n",
            "pdmesh/security_commands.py": "def keys():\n    from services.common.api_keys import hash_key\n",
            "bench/x.py": "from services.engine.factory import create_engine\nfrom tests.fakes import tiny_model\n",
        },
    )
    assert _found(tmp_path) == set()


@pytest.mark.parametrize(
    ("rel", "text", "imported"),
    [
        # workers do not import each other or the router
        (
            "services/decode/servicer.py",
            "from services.prefill.servicer import X\n",
            "services.prefill.servicer.X",
        ),
        ("services/prefill/x.py", "import services.router.auth as auth\n", "services.router.auth"),
        # only workers hold an engine, and the router does not use the worker framework
        ("services/router/x.py", "from services.worker import runtime\n", "services.worker.runtime"),
        ("services/gateway/x.py", "from services import engine\n", "services.engine"),
        # lower layers never import upward
        ("services/engine/x.py", "from services.worker.serving import f\n", "services.worker.serving.f"),
        ("services/model/x.py", "from services.engine.api import Engine\n", "services.engine.api.Engine"),
        ("kvtransfer/x.py", "from services.engine.api import Engine\n", "services.engine.api.Engine"),
        ("pdmesh/v1/x_pb2.py", "from services.common import config\n", "services.common.config"),
        ("services/common/x.py", "from pdmesh.launcher import Launcher\n", "pdmesh.launcher.Launcher"),
        # a relative import is resolved before it is judged
        ("services/common/sub/x.py", "from ...engine import api\n", "services.engine.api"),
        # a service that imports bench or tests
        ("services/router/x.py", "from tests.fakes import tiny_model\n", "tests.fakes.tiny_model"),
    ],
)
def test_each_kind_of_upward_or_sideways_import_is_caught(tmp_path, rel, text, imported):
    _tree(tmp_path, {rel: text})
    assert _found(tmp_path) == {(rel, 1, imported)}


def test_a_package_missing_from_the_table_is_reported(tmp_path):
    _tree(tmp_path, {"services/newthing/x.py": "import os\n"})
    (v,) = check(tmp_path, exceptions={})
    assert v.path == "services/newthing/x.py" and "in no part" in v.why


def test_an_exception_excuses_its_import_and_is_reported_once_unused(tmp_path):
    key = ("services/common/x.py", "services.engine.api")
    _tree(tmp_path, {"services/common/x.py": "from services.engine.api import Engine\n"})
    assert check(tmp_path, exceptions={key: "a known debt"}) == []
    (tmp_path / "services/common/x.py").write_text("import os\n")
    (v,) = check(tmp_path, exceptions={key: "a known debt"})
    assert v.path == key[0] and v.why.startswith("stale exception")


def test_every_exception_says_why():
    assert all(reason.strip() for reason in EXCEPTIONS.values())


def test_hidden_trees_such_as_a_peers_venv_are_not_checked(tmp_path):
    # bench/peers/dynamo/setup.sh puts a whole venv (~8,000 modules) under bench/: the
    # checker parsed all of it (2 minutes of `make test` on a checkout with the peer set up).
    forbidden = "from services.router.auth import hash_key\n"
    _tree(
        tmp_path,
        {
            "services/common/.venv/lib/x.py": forbidden,
            "services/common/errors.py": forbidden,
        },
    )
    assert _found(tmp_path) == {("services/common/errors.py", 1, "services.router.auth.hash_key")}
