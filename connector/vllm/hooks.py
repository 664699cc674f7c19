"""What every vLLM hook of tierkv shares: its timing, and what happens to an exception caught inside it.

:func:`_timed_hook` adds a hook's wall time and call to the counters of the role (``hook_seconds``, ``hook_calls``,
``hook_steps``); :func:`_hook_error` counts and logs an exception caught at a hook (one line per hook per 10 s): the
caller turns it into a miss or failed pages, so nothing from tierkv reaches vLLM's forward or its scheduler loop.
:func:`_params_log` is the rate-limited log of refused request controls (:data:`PARAMS_LOG_EVERY_S`).
"""
from __future__ import annotations

import functools
import logging
import time

logger = logging.getLogger("tierkv.vllm")


_hook_log = None


def _timed_hook(fn=None, *, step: bool = False):
    """Decorator of a vLLM hook method: adds its wall time (``time.perf_counter``, seconds) and one call to the
    ``hook_seconds`` / ``hook_calls`` counters of the role this connector plays (scheduler or worker counters;
    nothing while neither exists), and with ``step=True`` one to ``hook_steps`` (the hook vLLM calls once per
    step: ``build_connector_meta`` on the scheduler side, ``bind_connector_metadata`` on the worker side). What
    tierkv adds to an engine step is then ``hook_seconds / hook_steps`` per role, whatever the hook. Wall time
    only: the thread's CPU clock (``time.thread_time``) is a system call here (about 1 us warm, more right after a
    forward), two per hook call, and the hooks' own work is a few microseconds."""
    def wrap(f):
        @functools.wraps(f)
        def timed(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return f(self, *args, **kwargs)
            finally:
                t1 = time.perf_counter()
                owner = self._sched or self._worker
                if owner is not None:
                    c = owner.counters
                    c.hook_seconds += t1 - t0
                    c.hook_calls += 1
                    if step:
                        c.hook_steps += 1
        return timed
    return wrap(fn) if fn is not None else wrap


def _hook_error(counters, hook: str, err: BaseException) -> None:
    """An exception caught at a vLLM hook: counted and logged (at most one line per hook
    per 10 s, with the traceback of the first); the caller turns it into a miss or failed pages. Nothing from
    tierkv ever reaches vLLM's forward or its scheduler loop."""
    global _hook_log
    if _hook_log is None:
        from tierkv.storage_backends.common import RateLimitedLog
        _hook_log = RateLimitedLog(logger)
    if counters is not None:
        counters.hook_errors += 1
    _hook_log.warning(f"hook:{hook}", "tierkv: %s raised %r; served as a miss / failed pages (vLLM recomputes "
                      "them)", hook, err)
    logger.debug("tierkv: %s traceback", hook, exc_info=err)


_params_log_obj = None

#: refused request controls are logged at most once per this many seconds (the line counts the ones suppressed)
PARAMS_LOG_EVERY_S = 10.0


def _params_log():
    """The rate-limited logger of refused request controls (one line per :data:`PARAMS_LOG_EVERY_S`)."""
    global _params_log_obj
    if _params_log_obj is None:
        from tierkv.storage_backends.common import RateLimitedLog
        _params_log_obj = RateLimitedLog(logger, PARAMS_LOG_EVERY_S)
    return _params_log_obj
