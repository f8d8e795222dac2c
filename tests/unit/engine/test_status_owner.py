"""A sequence's status has one owner, the Scheduler (sequence.py, STYLE.md principle 9).

Walks the engine package and fails naming the file and line of any assignment
to a `.status` attribute outside scheduler.py (and Sequence's own __init__,
which sets the first state).
"""

from __future__ import annotations

import ast
from pathlib import Path

import services.engine

ENGINE = Path(services.engine.__file__).parent
OWNERS = {"scheduler.py", "sequence.py"}


def status_assignments(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        lines += [t.lineno for t in targets if isinstance(t, ast.Attribute) and t.attr == "status"]
    return lines


def test_the_checker_sees_an_assignment():
    assert status_assignments(ast.parse("x = 1\nseq.status = DECODING\n")) == [2]


def test_only_the_scheduler_changes_a_sequence_status():
    offenders = [
        f"{path.relative_to(ENGINE.parent.parent)}:{line}"
        for path in sorted(ENGINE.rglob("*.py"))
        if path.name not in OWNERS or path.parent != ENGINE
        for line in status_assignments(ast.parse(path.read_text()))
    ]
    assert offenders == []
