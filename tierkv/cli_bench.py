"""``tierkv bench e2e|transfer|storage [ARGS...]``: run a benchmark of ``benchmarks/``.

Each name maps to one module of the ``benchmarks`` package (:data:`BENCHMARKS`), run as
``python -m benchmarks.<module>`` with this interpreter from the repository root, the remaining arguments passed
through unchanged (``tierkv bench storage --quick``; ``tierkv bench e2e -- --help`` shows its own flags). The scripts show their own progress and write JSON (and charts) under ``benchmarks/results/``;
see ``benchmarks/README.md``. The benchmarks ship with the source tree, not with an installed wheel.

Exit status: the script's own (0 success, non-zero failure), 2 when the script cannot be found, 130 on Ctrl-C.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from tierkv.cli_common import EXIT_INTERRUPTED, EXIT_USAGE, CliError, fail

#: subcommand -> (module file under benchmarks/, one-line description)
BENCHMARKS = {
    "e2e": ("e2e_cpu.py", "end to end on vLLM's CPU backend: TTFT and throughput per tier and configuration"),
    "transfer": ("transfer.py", "L1 <-> L2 page transfer GB/s per layout, against memcpy"),
    "storage": ("storage.py", "L3 stores (file, ZMQ, Mooncake) against their raw medium and the peers"),
}


def repo_root() -> Path:
    """The source tree tierkv runs from (``tierkv/`` is installed in editable mode from it)."""
    return Path(__file__).resolve().parent.parent


def script_path(name: str) -> Path:
    """Path of benchmark ``name``. Raises :class:`CliError` (2) if the source tree has no such script."""
    script, _ = BENCHMARKS[name]
    p = repo_root() / "benchmarks" / script
    if not p.is_file():
        raise CliError(EXIT_USAGE, f"benchmark script {p} not found: the benchmarks ship with the tierkv source tree "
                                   "(git clone, pip install -e .)")
    return p


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.epilog = "exit codes: the benchmark's own; 2 if the script is missing; 130 interrupted"
    p.add_argument("benchmark", choices=sorted(BENCHMARKS),
                   help="; ".join(f"{k}: {v[1]}" for k, v in sorted(BENCHMARKS.items())))
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="passed to the script (e.g. --quick); put '--' first to pass --help")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        script = script_path(args.benchmark)
    except CliError as e:
        return fail(f"tierkv bench {args.benchmark}", e)
    rest = list(args.args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    try:
        return subprocess.call([sys.executable, "-m", f"benchmarks.{script.stem}", *rest], cwd=str(repo_root()),
                               env=env)
    except KeyboardInterrupt:
        print(f"tierkv bench {args.benchmark}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
