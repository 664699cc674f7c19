"""Fixtures for end-to-end tests that start real vLLM engines (see ``tests/helpers/engine.py`` for the runner).

- ``tiny_model`` (session): directory of the ``test`` preset of ``examples/make_tiny_model.py`` (Llama
  architecture, random seeded weights, local tokenizer), built once; default ``<repo>/models/test``
  (git-ignored), or ``$TIERKV_TEST_MODEL_DIR``.
- ``engine``: the ``tests.helpers.engine`` module (``run_workload``, ``run_job``, ``tierkv_kv_config``,
  ``example_kv_config``, ``stats_by_role``).
- ``engine_workdir``: a fresh directory for one engine run (job, log, connector stats files).

Every engine of the suite runs its EngineCore inside the engine subprocess and its model worker in a process of its
own (``_engine.ENGINE_CORE_IN_PROCESS``, set below): tierkv's scheduler and worker roles stay in separate processes
while each engine starts and stops in about a third of the time. The benchmarks keep vLLM's default layout.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
from tests.helpers import engine as _engine

_engine.ENGINE_CORE_IN_PROCESS = True


def _load_model_maker():
    spec = importlib.util.spec_from_file_location("tierkv_make_tiny_model", REPO_ROOT / "examples" / "make_tiny_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """Path (str) of the ``test`` preset model, built on first use and reused afterwards."""
    target = os.environ.get("TIERKV_TEST_MODEL_DIR") or str(REPO_ROOT / "models" / "test")
    return _load_model_maker().make_model(target, "test", quiet=True)


@pytest.fixture(scope="session")
def engine():
    """The ``_engine`` module: ``engine.run_workload(tiny_model, prompts, ...)`` etc."""
    return _engine


@pytest.fixture
def engine_workdir(tmp_path: Path) -> Path:
    """A fresh per-test directory to pass as ``workdir=`` (keeps the engine log next to the test's files)."""
    d = tmp_path / "engine"
    d.mkdir()
    return d
