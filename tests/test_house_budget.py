"""House budgets of the code folders: no class over ``CLASS_LINES`` lines, no module docstring over
``DOC_LINES`` lines, and no code that names a numbered section, an issue number or a field-scenario id.

The allow-lists (empty today) name an offender with its size (or count): an entry may only shrink, and the test
fails when a listed item grew or is back within budget (so a list is pruned as the code gets there).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("connector", "storage_backends", "kernels", "tierkv")
CLASS_LINES = 400
DOC_LINES = 15
REFERENCE = re.compile(r"§\d|issue \d+|\bR\d\d\b")

#: "path::Class" -> lines today
CLASS_ALLOW: dict[str, int] = {}
#: "path" -> docstring lines today
DOC_ALLOW: dict[str, int] = {}
#: "path" -> lines that name a section, an issue or a scenario id today
REFERENCE_ALLOW: dict[str, int] = {}


def _modules():
    for folder in FOLDERS:
        for p in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" not in p.parts:
                yield p.relative_to(ROOT).as_posix(), p.read_text()


def measure() -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    classes, docs, refs = {}, {}, {}
    for rel, text in _modules():
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LINES:
                classes[f"{rel}::{node.name}"] = node.end_lineno - node.lineno + 1
        doc = ast.get_docstring(tree, clean=False)
        if doc and len(doc.splitlines()) > DOC_LINES:
            docs[rel] = len(doc.splitlines())
        n = sum(1 for line in text.splitlines() if REFERENCE.search(line))
        if n:
            refs[rel] = n
    return classes, docs, refs


def _check(what: str, found: dict[str, int], allowed: dict[str, int]) -> list[str]:
    errors = [f"{what}: {k} is {v} (new offender)" for k, v in found.items() if k not in allowed]
    errors += [f"{what}: {k} grew from {allowed[k]} to {v}" for k, v in found.items() if k in allowed and v > allowed[k]]
    errors += [f"{what}: {k} is within budget now; remove it from the allow-list" for k in allowed if k not in found]
    errors += [f"{what}: {k} shrank from {allowed[k]} to {found[k]}; lower its entry" for k in allowed
               if k in found and found[k] < allowed[k]]
    return errors


def test_classes_docstrings_and_references_stay_within_budget():
    classes, docs, refs = measure()
    errors = (_check(f"class over {CLASS_LINES} lines", classes, CLASS_ALLOW)
              + _check(f"module docstring over {DOC_LINES} lines", docs, DOC_ALLOW)
              + _check("code naming a section, issue or scenario id", refs, REFERENCE_ALLOW))
    assert not errors, "\n".join(errors)
