"""Result files: which code wrote them, whether they still have what their table needs, writing and loading them.

A table in ``benchmarks/README.md`` is only as good as the JSON it is drawn from. Two rules keep them honest:

- every full run records the commit it ran at and the tracked files that differed from it
  (:func:`code_state`; ``"dirty"`` lists code paths only, results and the README do not count), and
- the table writers call :func:`check_results` first, which refuses a file that lacks a key the current
  benchmark writes or that was measured on uncommitted code, naming what is missing.

Benchmarks print their README table (:func:`print_section`); they never edit the README themselves.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.machine import machine

REPO = Path(__file__).resolve().parents[2]

#: paths a benchmark run itself writes: changes there do not make the measured code dirty
_OUTPUT_PATHS = ("benchmarks/results/", "benchmarks/README.md", "runs/")


class ResultsError(ValueError):
    """A result file cannot back a table: the message names the file, the missing keys or the dirty paths."""


def code_state(repo: Path = REPO) -> dict[str, Any]:
    """``{"commit": 40-hex HEAD, "dirty": [tracked paths that differ from HEAD, outputs excluded]}``.

    Outside a git checkout (a source tarball) ``commit`` is ``None`` and ``dirty`` is ``["(not a git checkout)"]``,
    so such a run can be printed but never turned into a README table."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": ["(not a git checkout)"]}
    dirty = []
    for line in status.splitlines():
        path = line[3:].split(" -> ")[-1].strip('"')
        if not path.startswith(_OUTPUT_PATHS):
            dirty.append(path)
    return {"commit": head, "dirty": sorted(dirty)}


def missing_keys(data: Any, schema: Any, where: str = "") -> list[str]:
    """Dotted paths of the keys ``schema`` requires that ``data`` lacks.

    ``schema`` is a dict whose values are nested schemas, ``None`` (any value) or ``"*"``-keyed dicts: the inner
    schema then applies to every value of that mapping (e.g. every configuration of a run)."""
    out: list[str] = []
    if not isinstance(schema, dict):
        return out
    if not isinstance(data, dict):
        return [where or "(top level)"]
    for key, sub in schema.items():
        if key == "*":
            for k, v in data.items():
                out += missing_keys(v, sub, f"{where}.{k}" if where else str(k))
            continue
        path = f"{where}.{key}" if where else key
        if key not in data:
            out.append(path)
        else:
            out += missing_keys(data[key], sub, path)
    return out


def check_results(data: dict, schema: dict, name: str, *, allow_quick: bool = False) -> None:
    """Raise :class:`ResultsError` unless ``data`` (a parsed result file called ``name``) has every key of
    ``schema``, a recorded commit, no dirty code paths and (unless ``allow_quick``) is not a quick smoke run."""
    problems: list[str] = []
    miss = missing_keys(data, schema)
    if miss:
        shown = ", ".join(miss[:12]) + (f" and {len(miss) - 12} more" if len(miss) > 12 else "")
        problems.append(f"lacks keys the current benchmark writes: {shown}")
    code = data.get("code") if isinstance(data.get("code"), dict) else {}
    if not code.get("commit"):
        problems.append("does not record the commit it ran at (code.commit)")
    if code.get("dirty"):
        problems.append("was measured on uncommitted changes to " + ", ".join(code["dirty"][:8]))
    if data.get("quick") and not allow_quick:
        problems.append("is a --quick smoke run")
    if problems:
        raise ResultsError(f"{name}: " + "; ".join(problems) + ". Re-run the benchmark from a clean checkout.")


def short(commit: str | None) -> str:
    return (commit or "?")[:12]



def print_section(body: str) -> None:
    """Print a benchmark's README table block (``body``): the maintainer puts it in place of the claim's table in
    ``benchmarks/README.md`` (one current table per claim; git keeps the ones it replaces)."""
    print("\n---- README table (for benchmarks/README.md) ----\n" + body.rstrip("\n") + "\n----")


def write_result(path: Path, data: dict) -> Path:
    """Write a result file (JSON, one-space indent, trailing newline), creating its folder; returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def load_result(path: Path) -> dict:
    """A result file's data. Raises :class:`ResultsError` naming the file if it is missing or not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ResultsError(f"{path}: cannot be read as a result file ({e})") from e


def add_result_args(ap, out: Path) -> None:
    """The arguments every benchmark that writes a result file and a README table takes: ``--out`` (the result
    JSON, default ``out``), ``--no-readme``, ``--readme-from JSON`` (print the table of a result file, and exit) and
    ``--note`` (a paragraph for the table, kept in the JSON: :func:`result_with_note`)."""
    ap.add_argument("--out", default=str(out), help="result JSON (default %(default)s)")
    ap.add_argument("--no-readme", action="store_true", help="do not print the README table at the end")
    ap.add_argument("--readme-from", default=None, metavar="JSON",
                    help="print the README table of a result file and exit")
    ap.add_argument("--note", default="", help="extra paragraph for the README table (kept in the JSON)")


def result_with_note(path: Path, note: str, key: str = "note") -> dict:
    """A result file's data for ``--readme-from``: with a non-empty ``note``, stored under ``key`` first and the file
    rewritten (the note belongs to the result, so the README section can be drawn again from the file alone)."""
    data = json.loads(Path(path).read_text())
    if note:
        data[key] = note
        Path(path).write_text(json.dumps(data, indent=1) + "\n")
    return data


def rotated(items, rep: int) -> list:
    """``items`` (a sequence) started at ``rep`` modulo its length: the order in which repetition ``rep`` of a
    benchmark runs its configurations, so that each takes every place in turn."""
    k = rep % len(items)
    return list(items[k:]) + list(items[:k])


def run_conditions(load_before: float, t0: float, **extra) -> dict[str, Any]:
    """The ``conditions`` of a benchmark run that started at ``t0`` (``time.time()``) with the 1-minute load average
    ``load_before``: CPU model, count and flags (:func:`~benchmarks.harness.machine.machine`), the load average now, the run's wall seconds, the date (UTC), the code
    measured (:func:`code_state`) and the run's own ``extra`` settings."""
    m = machine()
    return {"cpu": m["cpu"], "cpus": m["cpus"], "isa": m["isa"], "flags": m["flags"], "load_before": load_before,
            "load_after": os.getloadavg()[0], "wall_s": time.time() - t0, **extra,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **code_state()}


def spread(xs) -> dict[str, float]:
    """``{"median", "min", "max"}`` of the numbers ``xs`` (non-empty): how the benchmarks summarise a measure over
    repetitions. Raises ValueError for an empty ``xs``."""
    xs = sorted(xs)
    if not xs:
        raise ValueError("spread of no values")
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1]}


def spread_rows(runs: list[dict], configs, measures, carry=(), totals=()) -> list[dict]:
    """One row per (``shape``, configuration) of a per-page benchmark's ``runs`` (shapes in their first order,
    configurations in the order of ``configs``): the :func:`spread` of each of ``measures`` over its repetitions,
    the values of ``carry`` from its first run and the sums of ``totals``."""
    rows = []
    for shape in dict.fromkeys(r["shape"] for r in runs):
        for c in configs:
            mine = [r for r in runs if r["config"] == c and r["shape"] == shape]
            row = {"shape": shape, "config": c, **{k: sum(r[k] for r in mine) for k in totals},
                   **{k: mine[0][k] for k in carry}}
            row.update({k: spread(r[k] for r in mine) for k in measures})
            rows.append(row)
    return rows


def spread_cell(v: dict, digits: int = 0) -> str:
    """A :func:`spread` as a README table cell: ``median [min-max]`` with ``digits`` decimals."""
    return f"{v['median']:.{digits}f} [{v['min']:.{digits}f}-{v['max']:.{digits}f}]"
