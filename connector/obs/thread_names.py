"""OS names for tierkv's threads, so ``top -H``, ``ps -L`` and ``/proc/<pid>/task/*/comm`` tell them apart from the
engine's.

Python 3.11 names a ``threading.Thread`` only inside Python; the kernel keeps the name the thread inherited from its
creator (in vLLM's worker, ``VLLM::Worker``), so an operator cannot see how much CPU tierkv's I/O threads take beside
the forward's. :func:`name_this_thread` gives the calling thread its Python name as its kernel name (``prctl``
``PR_SET_NAME``: at most 15 bytes, so ``tierkv-`` becomes ``tkv-``). Linux only; elsewhere, or if the call fails,
nothing happens."""

from __future__ import annotations

import ctypes
import sys
import threading

PR_SET_NAME = 15          # prctl option: set the calling thread's name (linux/prctl.h)
COMM_BYTES = 15           # the kernel's name length, without the terminating NUL

_libc = None


def os_thread_name(name: str) -> bytes:
    """The kernel name used for Python thread name ``name``: ``tierkv-`` shortened to ``tkv-``, UTF-8, cut to 15
    bytes."""
    if name.startswith("tierkv-"):
        name = "tkv-" + name[len("tierkv-"):]
    return name.encode("utf-8", "replace")[:COMM_BYTES]


def name_this_thread() -> bool:
    """Set the calling thread's kernel name from its Python name (:func:`os_thread_name`). True if it was set."""
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        return _libc.prctl(PR_SET_NAME, ctypes.c_char_p(os_thread_name(threading.current_thread().name)), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
