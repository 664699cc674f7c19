"""Scheduling class of the L3 writer thread: it takes the CPU only where the engine leaves some, until its backlog
grows (``controller.writer_priority``).

On an engine whose compute threads keep every core busy (vLLM's CPU backend runs one OpenMP thread per core), a
backup written on one of those cores stops that thread, and every other thread of the forward then waits for it at
the next barrier: the write costs the engine more than its own CPU time. Linux's ``SCHED_IDLE`` class runs a thread
only on a core no normal thread wants (a waking idle thread never preempts one), so the writer fills the gaps
between forwards instead. Under sustained load those gaps may not suffice, and pages waiting for backup keep their
L2 slots locked; so when the writer's backlog passes ``high`` pages it returns to the normal class until the backlog
is down to ``low`` (hysteresis: one system call per change of class, none otherwise).

Going back from ``SCHED_IDLE`` to the normal class needs ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` of at least 20
(sched(7)); without it a thread would stay idle for good, so :func:`can_return_from_idle` tries both changes once
in a throwaway thread first, and where they fail the writer keeps the normal class (:class:`BackgroundPriority`
then does nothing). Linux only.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Optional

__all__ = ["WRITER_PRIORITIES", "BackgroundPriority", "can_return_from_idle"]

logger = logging.getLogger("tierkv.l3")

#: values of ``controller.writer_priority``: ``idle`` (SCHED_IDLE while the backlog is short), ``normal``
WRITER_PRIORITIES = ("idle", "normal")

_probe: Optional[bool] = None
_probe_lock = threading.Lock()


def _set_idle(idle: bool) -> None:
    """Put the calling thread into SCHED_IDLE (``idle``) or the normal class. Raises OSError as
    ``sched_setscheduler`` does (EPERM: not allowed back to normal)."""
    os.sched_setscheduler(0, os.SCHED_IDLE if idle else os.SCHED_OTHER, os.sched_param(0))


def can_return_from_idle() -> bool:
    """Whether a thread of this process may enter SCHED_IDLE and leave it again: tried once (cached) in a thread
    started for it, which ends whatever the outcome. False where the platform has no SCHED_IDLE."""
    global _probe
    with _probe_lock:
        if _probe is None:
            if not hasattr(os, "SCHED_IDLE"):
                _probe = False
            else:
                out = []

                def probe() -> None:
                    try:
                        _set_idle(True)
                        _set_idle(False)
                        out.append(True)
                    except OSError:
                        out.append(False)
                t = threading.Thread(target=probe, name="tierkv-prio-probe", daemon=True)
                t.start()
                t.join()
                _probe = bool(out and out[0])
        return _probe


class BackgroundPriority:
    """The scheduling class of one thread, chosen from its backlog (see the module docstring); every method is
    called by that thread itself.

    Args:
        enabled: use SCHED_IDLE at all (False: :meth:`update` does nothing and the thread stays normal).
        high: a backlog (pages) above this returns the thread to the normal class ...
        low: ... until it is at most this (``0 <= low <= high``).
    Raises:
        ValueError: ``low`` or ``high`` out of range.
    Attributes:
        raised: how many times the backlog sent the thread back to the normal class.
    """

    def __init__(self, enabled: bool, high: int, low: int):
        if not 0 <= low <= high:
            raise ValueError(f"need 0 <= low ({low}) <= high ({high})")
        self.enabled, self.high, self.low = bool(enabled), int(high), int(low)
        self.idle = False
        self.raised = 0

    def update(self, backlog: int) -> None:
        """Idle while ``backlog`` pages wait (including the batch about to be written) and the thread is not raised;
        normal above ``high`` until ``low``. A failed change (never expected after the probe) turns the policy
        off, back to normal if it can, logged once."""
        if not self.enabled:
            return
        want = backlog <= self.low if not self.idle else backlog <= self.high
        if want == self.idle:
            return
        try:
            _set_idle(want)
        except OSError as e:
            self.enabled = False
            logger.warning("tierkv L3: cannot change the writer thread's scheduling class (%s); it stays in the "
                           "%s class", e, "idle" if self.idle else "normal")
            return
        if self.idle and not want:
            self.raised += 1
        self.idle = want
