"""Helpers of the ``tierkv`` command tests (tests/cli), imported as ``tests.helpers.cli``: a module
name of its own, so it never depends on which ``conftest`` module was imported last."""
from __future__ import annotations

import json
import os
import subprocess
import sys

NS_A = bytes(range(16))
NS_B = bytes(range(16, 32))


def key(i: int) -> str:
    return f"{i:032x}"


def page(i: int, n: int) -> bytes:
    return bytes([(i * 7 + j) % 251 for j in range(256)]) * (n // 256)


def tierkv(*argv: str, json_out: bool = False, env: dict | None = None, timeout: float = 120):
    """Run the real console script ``tierkv`` (this interpreter's bin/). Returns the CompletedProcess (and the parsed
    JSON of stdout with ``json_out``)."""
    exe = os.path.join(os.path.dirname(sys.executable), "tierkv")
    r = subprocess.run([exe, *argv], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "COLUMNS": "200", **(env or {})})
    if json_out:
        return r, (json.loads(r.stdout) if r.returncode == 0 else None)
    return r


def one_line_error(r) -> str:
    """Assert the process failed with exactly one line on stderr and no traceback; return that line."""
    assert r.returncode != 0, r
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]
