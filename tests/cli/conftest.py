"""Fixtures of the ``tierkv`` command tests (tests/cli): real file stores, a real ``tierkv server`` process (the storage
tests' :func:`start_server`), a real ``mooncake_master`` (tests/helpers/mooncake_master.py). Plain helpers live in
``tests/helpers/cli.py``."""
from __future__ import annotations

import pytest



@pytest.fixture
def fresh_env(monkeypatch):
    monkeypatch.delenv("TIERKV_SERVER_TOKEN", raising=False)
