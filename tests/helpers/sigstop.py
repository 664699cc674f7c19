"""Freeze a server process for a hang test, and know that it is frozen.

``os.kill(pid, SIGSTOP)`` returns before the process has stopped: the kernel wakes one of its threads to take the
signal, and that thread stops the others only once it is scheduled. Until then, on a busy two-core machine, another
thread (a server's RPC or I/O thread) can still answer a request sent after ``kill`` returned, and a hang test then
sees a live server. :func:`sigstop` waits until the kernel reports every thread stopped."""

from __future__ import annotations

import os
import signal
import time


def all_threads_stopped(pid: int) -> bool:
    """True if every thread of ``pid`` is in state ``T`` (stopped by a signal) in ``/proc/<pid>/task/*/stat``.
    A thread that exits while being read is skipped; a process without a ``/proc`` entry counts as not stopped."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # the state is the first field after the parenthesised command name, which may itself contain ") "
        if stat[stat.rindex(b")") + 2:][:1] != b"T":
            return False
    return bool(tids)


def sigstop(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once all its threads are stopped. Raises RuntimeError if that has not happened
    within ``timeout_s`` seconds."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not all_threads_stopped(pid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"pid {pid} not stopped {timeout_s}s after SIGSTOP")
        time.sleep(0.002)  # polling interval for the observed thread states, not a synchronisation sleep
