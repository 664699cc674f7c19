"""Fixtures of the ``tierkv`` command tests (tests/cli): real file stores, a real ``tierkv server`` process (the storage
tests' :func:`start_server`), a real ``mooncake_master`` (tests/storage/mooncake_master.py). Plain helpers live in
``_cli_helpers.py``."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = str(Path(__file__).resolve().parent)
STORAGE_TESTS = str(Path(__file__).resolve().parent.parent / "storage")
for p in (HERE, STORAGE_TESTS):
    if p not in sys.path:
        sys.path.insert(0, p)


@pytest.fixture
def fresh_env(monkeypatch):
    monkeypatch.delenv("TIERKV_SERVER_TOKEN", raising=False)
