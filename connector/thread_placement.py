"""Where tierkv's own threads run and at what priority, so that its I/O does not stall the engine's forward.

On vLLM's CPU backend the forward is an OpenMP team, one thread bound to each of the rank's CPUs (``VLLM::Worker``:
thread 0 on the first CPU, thread 1 on the second, ...). A thread tierkv starts in that process inherits the
affinity of the thread that starts it, the worker's main thread, i.e. OpenMP thread 0's single CPU. Every slice
the L3 writer then takes is a slice OpenMP thread 0 loses, and the whole team waits for it at the next barrier: one
CPU-second of backups costs about one second of forward on every core. Each tierkv thread therefore sets, when it
starts (:func:`setup_this_thread`):

- its **CPUs** (``threads.cpus``): ``auto`` (default) takes the CPUs the engine process may use (the parent
  process's affinity and every thread's of this process, :func:`process_cpus`) less those the engine bound its
  compute threads to (:func:`bound_cpus`: threads of this process with a narrower affinity than the process's),
  e.g. the cores vLLM reserved with ``VLLM_CPU_NUM_OF_RESERVED_CPU``; when that leaves none (every CPU computes),
  all of the process's CPUs, so the kernel can place the thread where a core is idle instead of always on
  thread 0's. ``inherit`` keeps what the thread inherited; a CPU list (``"3"``, ``"2-3,6"``) is used as given (CPUs
  the process may not use are dropped; none left: ``inherit``). On a GPU engine nothing is bound and ``auto`` is a
  no-op;
- its **priority** (``threads.background_nice``, 0-19, default 0): background threads (the L3 backup writer, the
  stats-file flushers and the store threads they start, e.g. the file store's fsync helpers) raise their nice
  value to it. Off by default: these threads hold Python's GIL between their system calls, and a low-priority
  thread that the kernel deschedules while holding it stalls the engine's Python thread, which needs it between
  kernels (benchmarks/README.md, serve_cpu re-run ``thread_placement``: nice 10 did not make the engine faster).
  Threads on a request's path (L3 readers, the layer-wise loader) always keep the engine's priority.

The same idea as vLLM's NIXL connector on CPU, which moves its transfer thread to a core of its own. Linux only:
elsewhere, or when a call is refused, the thread keeps what it inherited (never an error: placement is an
optimisation). Threads started by a placed thread inherit its CPUs and nice value."""

from __future__ import annotations

import os
import re
import sys
import threading
from dataclasses import dataclass
from typing import Optional, Union

from .thread_names import name_this_thread

#: values of ``threads.cpus`` besides a CPU list
CPU_MODES = ("auto", "inherit")

_LIST_RE = re.compile(r"^\s*\d+(\s*-\s*\d+)?(\s*,\s*\d+(\s*-\s*\d+)?)*\s*$")


def parse_cpu_list(text: str) -> set[int]:
    """CPU ids of a Linux CPU list (``"0-3,6"``, as in ``taskset -c`` and ``/proc/*/status``).

    Raises:
        ValueError: not a list of ids and ranges ``a-b`` with ``a <= b``.
    """
    if not isinstance(text, str) or not _LIST_RE.match(text):
        raise ValueError(f"not a CPU list like '3' or '2-3,6': {text!r}")
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        a, b = int(lo), int(hi or lo)
        if a > b:
            raise ValueError(f"CPU range {part.strip()!r} ends before it starts")
        out.update(range(a, b + 1))
    return out


def check_cpus(value: str) -> str:
    """``value`` if it is a valid ``threads.cpus`` (one of :data:`CPU_MODES` or a CPU list). Raises ValueError."""
    if value in CPU_MODES:
        return value
    try:
        parse_cpu_list(value)
    except ValueError as e:
        raise ValueError(f"must be {' or '.join(CPU_MODES)} or a CPU list like '3' or '2-3,6' ({e})") from None
    return value


@dataclass(frozen=True)
class Placement:
    """The process's policy: ``cpus`` (``auto``, ``inherit`` or a CPU list) and ``background_nice`` (0-19)."""

    cpus: str = "auto"
    background_nice: int = 0


_policy = Placement()
_policy_lock = threading.Lock()


def configure(cpus: str = "auto", background_nice: int = 0) -> Placement:
    """Set the policy of the threads this process starts from now on (the connector calls it with the ``threads``
    section of its config before it starts any thread). Raises ValueError for a bad ``cpus`` or a nice value outside
    0-19."""
    global _policy
    check_cpus(cpus)
    if not 0 <= int(background_nice) <= 19:
        raise ValueError(f"background_nice must be in 0..19, got {background_nice}")
    with _policy_lock:
        _policy = Placement(cpus, int(background_nice))
        return _policy


def policy() -> Placement:
    """The policy set by :func:`configure` (default ``auto``, nice 0)."""
    return _policy


def _affinity(pid: int) -> Optional[set[int]]:
    try:
        return set(os.sched_getaffinity(pid))
    except (OSError, AttributeError):
        return None


def _thread_ids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []


def process_cpus() -> set[int]:
    """CPUs the engine process may use: the parent process's affinity (the engine core or API server that started
    this worker, whose mask a ``taskset`` of the server sets) and the affinity of every thread of this process. Empty
    where Linux's affinity calls are missing."""
    cpus = _affinity(os.getppid()) or set()
    for tid in _thread_ids():
        cpus |= _affinity(tid) or set()
    return cpus


def _kernel_name(tid: int) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def bound_cpus(allowed: set[int]) -> set[int]:
    """CPUs to which a thread of this process, not one of tierkv's (kernel name ``tkv-...``, including the threads
    those start), is bound more narrowly than ``allowed``: vLLM's OpenMP compute threads on its CPU backend, nothing
    on a GPU engine."""
    bound: set[int] = set()
    for tid in _thread_ids():
        if _kernel_name(tid).startswith("tkv-"):
            continue
        a = _affinity(tid)
        if a and a < allowed:
            bound |= a
    return bound


def io_cpus(cpus: Union[str, set[int]] = "auto") -> Optional[set[int]]:
    """The CPUs a tierkv thread should run on under ``cpus`` (a :data:`CPU_MODES` value, a CPU list or a set), or
    None to keep what it inherited (``inherit``; nothing known about the process's CPUs)."""
    if cpus == "inherit":
        return None
    allowed = process_cpus()
    if not allowed:
        return None
    if cpus == "auto":
        free = allowed - bound_cpus(allowed)
        return free or allowed
    wanted = parse_cpu_list(cpus) if isinstance(cpus, str) else set(cpus)
    return (wanted & allowed) or None


def setup_this_thread(background: bool = False) -> dict:
    """Name the calling thread for the OS (:func:`tierkv.connector.thread_names.name_this_thread`), move it to the
    policy's CPUs and, if ``background``, raise its nice value to the policy's ``background_nice``. Returns what was
    done: ``{"cpus": set or None, "nice": int or None}`` (None: left as inherited). Never raises."""
    name_this_thread()
    done: dict = {"cpus": None, "nice": None}
    if not sys.platform.startswith("linux"):
        return done
    p = _policy
    try:
        want = io_cpus(p.cpus)
        if want is not None and want != _affinity(0):
            os.sched_setaffinity(0, want)       # pid 0: the calling thread only
            done["cpus"] = want
    except (OSError, ValueError):
        pass
    if background:
        try:
            tid = threading.get_native_id()
            now = os.getpriority(os.PRIO_PROCESS, tid)
            if p.background_nice > now:        # only ever lower the priority (raising it needs privileges)
                os.setpriority(os.PRIO_PROCESS, tid, p.background_nice)
                done["nice"] = p.background_nice
        except (OSError, AttributeError):
            pass
    return done
