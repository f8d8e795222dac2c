"""docker/Dockerfile and .dockerignore, checked without Docker: multi-stage, pinned,
non-root, a `pdmesh health` HEALTHCHECK, and every COPY source present and not ignored."""

from __future__ import annotations

import fnmatch
import re
import shlex

from tests.unit.deploy import repo

DOCKERFILE = repo.ROOT / "docker" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def stages() -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for op, rest in instructions():
        if op == "FROM":
            result.append([])
        if result:
            result[-1].append((op, rest))
    return result


def test_multi_stage_from_a_pinned_python():
    base = next(rest for op, rest in instructions() if op == "ARG" and rest.startswith("PYTHON_IMAGE="))
    tag = base.split("=", 1)[1]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", tag), tag  # a patch release, never :latest
    assert len(stages()) >= 2
    assert stages()[-1][0][1].startswith("${PYTHON_IMAGE}")


def test_torch_cpu_pinned_then_the_project_under_constraints():
    runs = " ".join(rest for op, rest in instructions() if op == "RUN")
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in runs
    assert "pip install -c constraints.txt ." in runs
    assert runs.index("torch==2.13.0") < runs.index("-c constraints.txt")


def test_runtime_stage_runs_as_an_unprivileged_user():
    final = stages()[-1]
    users = [rest for op, rest in final if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")


def test_healthcheck_uses_pdmesh_health_and_default_command_is_a_service():
    final = stages()[-1]
    health = next(rest for op, rest in final if op == "HEALTHCHECK")
    assert "CMD pdmesh health" in health
    cmd = next(rest for op, rest in final if op == "CMD")
    argv = shlex.split(cmd.strip("[]").replace(",", " "))
    assert argv[:2] == ["python", "-m"] and repo.module_exists(argv[2])


def _ignored(path: str, patterns: list[str]) -> bool:
    ignored = False
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat.lstrip("!").removeprefix("**/")
        if fnmatch.fnmatch(path, pat) or fnmatch.fnmatch(path.split("/")[0], pat):
            ignored = not negate
    return ignored


def test_copy_sources_exist_and_are_not_dockerignored():
    patterns = [
        line.strip()
        for line in (repo.ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = []
    for op, rest in instructions():
        if op == "COPY" and "--from=" not in rest:
            sources += rest.split()[:-1]
    assert {"pyproject.toml", "constraints.txt", "pdmesh", "services", "kvtransfer"} <= set(sources)
    for src in sources:
        assert (repo.ROOT / src).exists(), src
        assert not _ignored(src, patterns), f"{src} is excluded by .dockerignore"
    for heavy in (".venv", ".git", "tests"):
        assert _ignored(heavy, patterns), f"{heavy} should stay out of the build context"
