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


def build_args() -> dict[str, str | None]:
    out = {}
    for op, rest in instructions():
        if op == "ARG":
            name, eq, default = rest.partition("=")
            out[name] = default if eq else None
    return out


def test_torch_cpu_pinned_then_the_project_under_constraints():
    """torch's CPU build from build arguments (an index or local wheels), then the project."""
    args = build_args()
    assert args["TORCH_SPEC"] == "torch==2.13.0"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    runs = " ".join(rest for op, rest in instructions() if op == "RUN")
    assert '--index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"' in runs
    assert (
        "-c constraints.txt -r requirements.txt" in runs
        and "pip install --no-deps -c constraints.txt ." in runs
    )
    assert runs.index("$TORCH_SPEC") < runs.index("-c constraints.txt")


def test_builds_offline_from_a_base_given_as_an_argument():
    """No `# syntax=` line (it pulls a frontend from Docker Hub); the base, pip's index and a
    local wheels folder are build arguments; pip's settings are unset unless given."""
    text = DOCKERFILE.read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.MULTILINE | re.IGNORECASE)
    args = build_args()
    assert {"PYTHON_IMAGE", "WHEELS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"} <= set(args)
    assert args["PIP_INDEX_URL"] is None and args["PIP_EXTRA_INDEX_URL"] is None
    assert (repo.ROOT / args["WHEELS"]).is_dir()
    froms = [rest for op, rest in instructions() if op == "FROM"]
    assert froms and all(f.startswith("${PYTHON_IMAGE}") for f in froms)


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
    args = build_args()
    for op, rest in instructions():
        if op == "COPY" and "--from=" not in rest:
            sources += [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], s) for s in rest.split()[:-1]]
    assert {"pyproject.toml", "constraints.txt", "pdmesh", "services", "kvtransfer", "docker/wheels"} <= set(
        sources
    )
    for src in sources:
        assert (repo.ROOT / src).exists(), src
        assert not _ignored(src, patterns), f"{src} is excluded by .dockerignore"
    for heavy in (".venv", ".git", "tests"):
        assert _ignored(heavy, patterns), f"{heavy} should stay out of the build context"
