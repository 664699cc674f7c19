"""Load a script of ``benchmarks/`` as a module for its tests (the folder is not a package)."""
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_benchmark(stem: str):
    """``benchmarks/<stem>.py`` as the module ``tierkv_bench_<stem>`` (executed once per call)."""
    spec = importlib.util.spec_from_file_location(f"tierkv_bench_{stem}", REPO / "benchmarks" / f"{stem}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
