"""The generated parts of ``docs/architecture.md``: module layout, L3 backends and vLLM hooks, read from the code.

Each part sits between two markers, ``<!-- BEGIN generated: NAME ... -->`` and ``<!-- END generated: NAME -->``:

- ``layout`` (section "Layout"): every module of ``connector/``, ``storage_backends/``, ``kernels/`` and ``tierkv/`` with the
  summary of its module docstring (its first paragraph);
- ``l3-backends`` (section "L3 stores"): the values of ``l3.backend`` in ``storage_backends/factory.py`` with the module and class
  of each store and the summary of the class docstring;
- ``vllm-hooks`` (section "Two roles in vLLM"): the methods of vLLM's ``KVConnectorBase_V1`` that ``TierKVConnector``
  (``connector/vllm/connector.py``) implements, grouped as vLLM's base class groups them (scheduler side, worker
  side), each with the summary of its docstring.

Modules and hooks are read with :mod:`ast` (nothing is imported: no torch, no vLLM); the backend list imports the
factory. ``python -m tierkv.docs_gen --write`` rewrites the parts in place, ``--check`` exits 1 when they differ, and
``tests/cli/test_docs_gen.py`` fails when the document and the code disagree.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import re
import sys
from pathlib import Path
from typing import Optional

#: the command that rewrites the generated parts (named by the drift test's failure message)
REGENERATE = "python -m tierkv.docs_gen --write"

#: packages whose modules the layout lists, as (import name, folder name in the source tree)
PACKAGES = (("tierkv.connector", "connector"), ("tierkv.storage_backends", "storage_backends"),
            ("tierkv.kernels", "kernels"), ("tierkv", "tierkv"))

#: vLLM's connector base class: module path inside the ``vllm`` package, and class name
VLLM_BASE = ("distributed/kv_transfer/kv_connector/v1/base.py", "KVConnectorBase_V1")

#: group titles of the hook table, in table order (the first three are sections of vLLM's base class)
SIDES = {"scheduler": "scheduler side", "worker": "worker side", "both": "both roles", "class": "class level"}


def begin(name: str) -> str:
    return f"<!-- BEGIN generated: {name} (`{REGENERATE}`; do not edit by hand) -->"


def end(name: str) -> str:
    return f"<!-- END generated: {name} -->"


def _package_dir(pkg: str) -> Path:
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"cannot locate package {pkg}")
    return Path(list(spec.submodule_search_locations)[0])


def source_root() -> Path:
    """The repository root (the folder holding ``connector/``, ``tierkv/`` and ``docs/``)."""
    return _package_dir("tierkv").parent


#: a docstring's pointer into the old numbered sections of the architecture document ("docs/architecture.md §N",
#: "docs §N Rnn"), left out of the generated parts: the document they sit in has no numbered sections
_SECTION_CITE = re.compile(r",?\s*docs(?:/architecture\.md)?,?\s*§\s*\d+(?:\s*R\d+)?(?:,\s*R\d+)*")


def plain(text: str) -> str:
    """Docstring text as one Markdown line: reST roles and literals become code spans, citations of numbered
    document sections are dropped (with the parentheses they leave empty), whitespace collapses."""
    text = _SECTION_CITE.sub("", text)
    text = re.sub(r"\s*\(\s*\)", "", text)
    text = re.sub(r":[a-z]+:`~([^`]+)`", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text)  # ~: last part
    text = re.sub(r":[a-z]+:`\.?([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    return " ".join(text.split())


def summary(doc: Optional[str]) -> Optional[str]:
    """The first paragraph of a docstring, as one line (None without a docstring)."""
    if not doc or not doc.strip():
        return None
    return plain(doc.strip().split("\n\n", 1)[0])


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# -- layout ----------------------------------------------------------------------------------------------------------

def modules() -> list[tuple[str, Optional[str]]]:
    """``(folder/file.py, docstring summary)`` of every module of :data:`PACKAGES`; empty ``__init__.py`` left out."""
    out = []
    for pkg, folder in PACKAGES:
        for path in sorted(_package_dir(pkg).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            if path.name == "__init__.py" and not text.strip():
                continue
            rel = path.relative_to(_package_dir(pkg)).as_posix()
            out.append((f"{folder}/{rel}", summary(ast.get_docstring(ast.parse(text)))))
    return out


def layout_part() -> str:
    rows = [[f"`{m}`", s or "*(no module docstring)*"] for m, s in modules()]
    return _table(["module", "what it is (its docstring's summary)"], rows)


# -- L3 backends -----------------------------------------------------------------------------------------------------

def l3_backends() -> list[tuple[str, str, str, Optional[str]]]:
    """``(l3.backend value, module, class, class docstring summary)`` per store: the names of the factory's public
    list ``L3_BACKENDS`` (``none`` left out), module and class from its registry ``BACKENDS``; the store classes are
    imported, so an optional dependency missing here leaves its summary out."""
    factory = importlib.import_module("tierkv.storage_backends.factory")
    out = []
    for name in factory.L3_BACKENDS:
        if name == "none":
            continue
        entry = factory.BACKENDS[name]
        mod_name, cls_name = entry.module, entry.cls
        try:
            doc = getattr(importlib.import_module(mod_name), cls_name).__doc__
        except ImportError:
            doc = None
        out.append((name, mod_name, cls_name, summary(doc)))
    return out


def backends_part() -> str:
    rows = []
    for name, mod_name, cls_name, doc in l3_backends():
        path = mod_name.replace("tierkv.", "", 1).replace(".", "/")
        path += "/" if hasattr(importlib.import_module(mod_name), "__path__") else ".py"  # a package: its folder
        rows.append([f"`{name}`", f"`{path}`", f"`{cls_name}`", doc or "*(no class docstring)*"])
    return _table(["`l3.backend`", "module", "class", "what it is"], rows)


# -- vLLM hooks ------------------------------------------------------------------------------------------------------

def _class(tree: ast.Module, pred) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and pred(node):
            return node
    raise RuntimeError("docs_gen: class not found")


def _methods(cls: ast.ClassDef) -> list:
    return [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def vllm_sides(base_source: str) -> dict[str, str]:
    """Public method of vLLM's base class -> ``scheduler``, ``worker`` or ``both`` (defined before the
    "Worker-side methods" section), ``class`` for class methods and static methods."""
    lines = base_source.splitlines()
    cls = _class(ast.parse(base_source), lambda c: c.name == VLLM_BASE[1])
    marks = {}
    for i, line in enumerate(lines[cls.lineno - 1:cls.end_lineno], start=cls.lineno):
        m = re.match(r"\s*#\s*(Worker|Scheduler)-side methods", line)
        if m:
            marks[m.group(1).lower()] = i
    if set(marks) != {"worker", "scheduler"}:
        raise RuntimeError(f"docs_gen: vLLM's {VLLM_BASE[1]} no longer has its 'Worker-side methods' and "
                           "'Scheduler-side methods' sections; update tierkv/docs_gen.py")
    sides = {}
    for fn in _methods(cls):
        if fn.name.startswith("_"):
            continue
        decorators = {d.id for d in fn.decorator_list if isinstance(d, ast.Name)}
        if decorators & {"classmethod", "staticmethod"}:
            sides[fn.name] = "class"
            continue
        after = [side for side, line in sorted(marks.items(), key=lambda kv: kv[1]) if fn.lineno > line]
        sides[fn.name] = after[-1] if after else "both"
    return sides


def vllm_base_source() -> str:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("docs_gen: vLLM is not installed (the hook table reads its KVConnectorBase_V1)")
    return (Path(list(spec.submodule_search_locations)[0]) / VLLM_BASE[0]).read_text(encoding="utf-8")


def hooks(base_source: Optional[str] = None, connector_source: Optional[str] = None) -> list[tuple[str, str, Optional[str]]]:
    """``(side, method, docstring summary)`` of every base-class method ``TierKVConnector`` defines, by side
    (:data:`SIDES` order) and then in the connector's source order."""
    sides = vllm_sides(base_source if base_source is not None else vllm_base_source())
    if connector_source is None:
        connector_source = (_package_dir("tierkv.connector") / "vllm" / "connector.py").read_text(encoding="utf-8")
    cls = _class(ast.parse(connector_source),
                 lambda c: any(getattr(b, "id", getattr(b, "attr", None)) == VLLM_BASE[1] for b in c.bases))
    found = [(sides[fn.name], fn.name, summary(ast.get_docstring(fn))) for fn in _methods(cls) if fn.name in sides]
    order = list(SIDES)
    return sorted(found, key=lambda h: order.index(h[0]))  # stable: source order within a side


def hooks_part() -> str:
    rows = [[SIDES[side], f"`{name}`", doc or "*(no docstring)*"] for side, name, doc in hooks()]
    return _table([f"side (as vLLM's `{VLLM_BASE[1]}` groups it)", "hook", "what tierkv does"], rows)


# -- the document ----------------------------------------------------------------------------------------------------

PARTS = {"vllm-hooks": hooks_part, "l3-backends": backends_part, "layout": layout_part}


def doc_path() -> Path:
    return source_root() / "docs" / "architecture.md"


def section(text: str, name: str) -> Optional[str]:
    """The text between the markers of part ``name`` (stripped), or None when a marker is missing."""
    b, e = begin(name), end(name)
    if b not in text or e not in text:
        return None
    return text.split(b, 1)[1].split(e, 1)[0].strip()


def render(text: str) -> str:
    """``text`` with every generated part replaced by what the code generates now."""
    for name, part in PARTS.items():
        if section(text, name) is None:
            raise RuntimeError(f"docs_gen: the document has no markers {begin(name)!r} ... {end(name)!r}")
        head, rest = text.split(begin(name), 1)
        text = f"{head}{begin(name)}\n{part()}\n{end(name)}{rest.split(end(name), 1)[1]}"
    return text


def stale_parts(text: str) -> list[str]:
    """Names of the parts whose text in ``text`` differs from what the code generates (missing markers included)."""
    return [name for name, part in PARTS.items() if section(text, name) != part().strip()]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tierkv.docs_gen", description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--doc", default=None, help="the document (default: docs/architecture.md of the source tree)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help="rewrite the generated parts in place")
    g.add_argument("--check", action="store_true", help="exit 1 when a generated part is stale")
    args = p.parse_args(argv)
    path = Path(args.doc) if args.doc else doc_path()
    text = path.read_text(encoding="utf-8")
    if args.write:
        new = render(text)
        if new != text:
            path.write_text(new, encoding="utf-8")
        print(f"{path}: {'updated' if new != text else 'already up to date'}")
        return 0
    if args.check:
        stale = stale_parts(text)
        if stale:
            print(f"{path}: generated parts out of date: {', '.join(stale)}; run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    for name, part in PARTS.items():
        print(f"{begin(name)}\n{part()}\n{end(name)}\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
