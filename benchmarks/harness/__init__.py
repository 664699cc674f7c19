"""What every benchmark does, in one place.

- :mod:`.servers`: start and stop, by PID, the servers a benchmark runs against: vLLM's OpenAI server, the
  ``tierkv server`` (ZMQ L3), a ``mooncake_master`` with a segment-holding process, an LMCache server.
- :mod:`.stats`: read vLLM's ``/metrics`` and tierkv's stats files, and their changes over a run.
- :mod:`.procs`: CPU seconds, threads and resident memory of a process tree, from ``/proc``.
- :mod:`.results`: write and load result files, the commit they were measured at, spreads, the table check.
- :mod:`.machine`: the machine a result was measured on (``lscpu`` model and flags, cores, load average).

:func:`load_file` loads a script that is not in a package (``examples/make_tiny_model.py``, the e2e tests'
engine runner) as a module, by path.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


def load_file(name: str, path: Path):
    """The Python file ``path`` as module ``name`` (loaded once per process, kept in ``sys.modules``)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def package_path(dest: Path) -> str:
    """A folder under ``dest`` holding only a link to this ``benchmarks`` package, for a subprocess's ``PYTHONPATH``:
    ``python -m benchmarks.<name>`` then runs from any working directory, and the repository's other top-level
    folders (``kernels``, ``configs``...) never shadow installed packages of the same name."""
    d = Path(dest) / "benchmarks-path"
    d.mkdir(parents=True, exist_ok=True)
    link = d / "benchmarks"
    if not link.exists():
        link.symlink_to(REPO / "benchmarks", target_is_directory=True)
    return str(d)


def make_tiny_model():
    """``examples/make_tiny_model.py`` as a module (its ``make_model(dir, preset)`` and ``PRESETS``)."""
    return load_file("tierkv_make_tiny_model", REPO / "examples" / "make_tiny_model.py")


def e2e_engine():
    """``tests/helpers/engine.py`` as a module: the in-process vLLM engine runner the e2e tests use."""
    return load_file("tierkv_e2e_engine", REPO / "tests" / "helpers" / "engine.py")
