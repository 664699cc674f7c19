"""SGLang adapter tests. Importing SGLang's modules sets process environment variables (TORCHINDUCTOR_CACHE_DIR,
TORCHINDUCTOR_COMPILE_THREADS=1, TRITON_CACHE_DIR, LD_LIBRARY_PATH, ...) that would leak into every later test and
the vLLM engines it starts (one pytest process runs the whole suite). The environment is snapshotted when this
directory is collected (before its test modules import SGLang) and restored once collection ends and after each
test here."""
from __future__ import annotations

import os

import pytest

_ENV = dict(os.environ)


def _restore_env() -> None:
    for k in [k for k in os.environ if k not in _ENV and not k.startswith("PYTEST_")]:
        del os.environ[k]
    for k, v in _ENV.items():
        if os.environ.get(k) != v and not k.startswith("PYTEST_"):
            os.environ[k] = v


def pytest_collection_finish(session) -> None:
    _restore_env()


@pytest.fixture(autouse=True)
def _environment_as_before_sglang():
    yield
    _restore_env()
