"""The layering of pdmesh as data, and the checker that enforces it.

Usage: python scripts/import_rules.py    (prints every forbidden import; exit 1 if any)

`ALLOWED` says, for each top-level part of the code, which other parts its
modules may import (its own part is always allowed). It is the picture in
docs/DESIGN.md "Layers": imports only point down. `check(root)` walks every
module under the checked folders with `ast`, every import statement included
(inside functions and `if TYPE_CHECKING:` blocks too: a lazy import is still a
dependency), and returns one `Violation` (file, line, what) for each import the
table forbids. tests/unit/layering/test_import_rules.py runs it on the
repository in `make test`, and on small fixture trees to show what it catches.

`EXCEPTIONS` lists the forbidden imports that are known and not yet removed,
each with its reason; an exception that no longer matches an import is itself
reported, so the list only shrinks.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

CONTRACT = "pdmesh.v1"
COMMON = "services.common"
MODEL = "services.model"
KV_LIB = "kvtransfer"
ENGINE = "services.engine"
WORKER = "services.worker"
_SERVICE_BASE = frozenset({COMMON, MODEL, KV_LIB, CONTRACT})

# part -> the parts its modules may import. A part is a package named by its
# dotted prefix; a module belongs to the longest prefix that matches it.
ALLOWED: dict[str, frozenset[str]] = {
    # benchmarks may use anything, tests' fakes included
    "bench": frozenset({"*"}),
    # client, CLI, local launcher: the contract and the helpers it shares with the
    # servers (TLS, config flags, the API-key format), the model layer for the catalog
    # of servable models (`pdmesh up --model`), and the planner's plain cores, which
    # `pdmesh up --planner` runs beside the processes it owns; services only as processes
    "pdmesh": frozenset({CONTRACT, COMMON, MODEL, "services.planner"}),
    # one package per service; workers do not import each other or the router,
    # and only workers hold an engine; the router serves the gateway's HTTP app
    "services.router": _SERVICE_BASE | {"services.gateway"},
    # the router's HTTP door: the router process serves the gateway's app and hands it
    # the request flow (services/router/http_door.py); the gateway never imports the router
    "services.gateway": _SERVICE_BASE,
    "services.kvtransfer": _SERVICE_BASE,
    "services.planner": _SERVICE_BASE,
    "services.decode": _SERVICE_BASE | {WORKER, ENGINE},
    "services.prefill": _SERVICE_BASE | {WORKER, ENGINE},
    # the worker framework (bootstrap and what decode and prefill serve alike)
    WORKER: frozenset({ENGINE, KV_LIB, MODEL, COMMON, CONTRACT}),
    ENGINE: frozenset({MODEL, KV_LIB, COMMON, CONTRACT}),
    KV_LIB: frozenset({COMMON, CONTRACT}),
    # tokenizer, model presets and config reading, block hashing
    MODEL: frozenset({COMMON, CONTRACT}),
    # config, logging, metrics, health, server bootstrap, errors base
    COMMON: frozenset({CONTRACT}),
    # generated stubs
    CONTRACT: frozenset(),
    # the package `services` itself (its empty __init__); its subpackages are parts of their own
    "services": frozenset(),
}
_WHOLE_NAME_ONLY = frozenset({"services"})

# Top-level names that are ours: an import of anything else (stdlib, PyPI) is not checked.
OURS = frozenset({"bench", "pdmesh", "services", "kvtransfer", "tests", "scripts"})
# Folders whose modules are checked. tests/ and scripts/ may import anything.
CHECKED = ("bench", "pdmesh", "services", "kvtransfer")

# (importing file, imported module) -> why it is still there. Each is a debt.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("services/gateway/launch.py", "pdmesh.launcher"): (
        "the standalone gateway's launch spec (bench/front_ab.py, bench/profile_front.py) builds on the launcher"
    ),
    (
        "pdmesh/commands.py",
        "bench.loadgen",
    ): "`pdmesh bench` runs the load generator in process (bench sits above pdmesh)",
}


@dataclass(frozen=True)
class Violation:
    path: str  # relative to the root, with forward slashes
    line: int
    importer: str  # the importing module's part
    imported: str  # the imported module
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.why}"


def part_of(module: str) -> str | None:
    """The part (key of ALLOWED) a dotted module name belongs to, None if unknown."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in ALLOWED and (n == len(parts) or prefix not in _WHOLE_NAME_ONLY):
            return prefix
    return None


def module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    names = list(rel.parts)
    if names[-1] == "__init__":
        names.pop()
    return ".".join(names)


def imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the tree, relative ones resolved.

    `from a.b import c` yields `a.b.c`: `c` may be a submodule (`from services
    import engine`), and a name inside `a.b` still lies in a.b's part."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                anchor = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                base = ".".join([*anchor, base] if base else anchor)
            found.extend(
                (node.lineno, f"{base}.{alias.name}" if base else alias.name) for alias in node.names
            )
    return found


def check(
    root: Path,
    folders: tuple[str, ...] = CHECKED,
    exceptions: dict[tuple[str, str], str] | None = None,
) -> list[Violation]:
    """Every import under `root`/`folders` that ALLOWED forbids and `exceptions`
    (default EXCEPTIONS) does not excuse, plus every exception that matched nothing."""
    exceptions = EXCEPTIONS if exceptions is None else exceptions
    found: list[Violation] = []
    used: set[tuple[str, str]] = set()
    seen: set[tuple[str, int, str | None]] = set()  # one report per statement and part
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root)
            if any(part.startswith(".") for part in relative.parts):
                continue  # a peer's venv (bench/peers/*/.venv) and other hidden, untracked trees
            rel = relative.as_posix()
            module = module_name(root, path)
            own = part_of(module)
            if own is None:
                found.append(Violation(rel, 1, "?", "", f"{module} is in no part of the import table"))
                continue
            allowed = ALLOWED[own]
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
            for line, target in imports(tree, module, path.name == "__init__.py"):
                if target.split(".")[0] not in OURS or "*" in allowed:
                    continue
                dest = part_of(target)
                if dest == own or (dest is not None and dest in allowed):
                    continue
                key = next((k for k in exceptions if k[0] == rel and _within(target, k[1])), None)
                if key is not None:
                    used.add(key)
                    continue
                if (rel, line, dest) in seen:
                    continue
                seen.add((rel, line, dest))
                what = f"{dest} (module {target})" if dest is not None else f"{target}, which is in no part"
                found.append(Violation(rel, line, own, target, f"{own} may not import {what}"))
    for key in sorted(exceptions.keys() - used):
        found.append(Violation(key[0], 1, "", key[1], f"stale exception: no import of {key[1]} here"))
    return found


def _within(target: str, module: str) -> bool:
    return target == module or target.startswith(module + ".")


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    found = check(root)
    for v in found:
        print(v)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
