"""Heap watch: record, in one process of a vLLM server, every allocation made between two marker files, with
memray (Python stacks only), to find what a long run keeps. A benchmark diagnostic, not part of tierkv.

Python imports ``sitecustomize`` at start-up from the first folder on ``sys.path`` that holds one; put this folder on
the server's ``PYTHONPATH`` (``python -m benchmarks.serve_cpu --soak --heap-watch`` does) and set:

- ``TIERKV_HEAP_WATCH``: a folder. Nothing happens without it.
- ``TIERKV_HEAP_WATCH_PROC``: the process to watch, by the start of its ``/proc/self/comm`` (default
  ``VLLM::Worker``, the name vLLM gives its worker process).
- ``TIERKV_HEAP_WATCH_MEMRAY``: a folder holding memray (``pip install --target DIR memray``), from which memray
  alone is loaded when the environment has none (the folder is never put on the import path, so the packages
  memray brings along never shadow the environment's own).

Once the file ``DIR/START`` exists, allocations are recorded into ``DIR/memray-<pid>.bin`` until ``DIR/STOP`` exists;
then ``DIR/done-<pid>`` is written (``DIR/error-<pid>`` with the reason if memray could not start). Markers are
polled every second. Every process of the server runs one more thread (``heap-watch``) for its whole life, so
thread counts taken at any two moments still compare. ``benchmarks/heap_watch/report.py`` sums what was allocated and not freed by Python stack.
"""
import importlib.machinery
import importlib.util
import os
import sys
import threading
import time

_DIR = os.environ.get("TIERKV_HEAP_WATCH")


def import_memray():
    """memray from the environment, else from the folder ``TIERKV_HEAP_WATCH_MEMRAY`` names (memray alone)."""
    extra = os.environ.get("TIERKV_HEAP_WATCH_MEMRAY")
    if extra and "memray" not in sys.modules and importlib.util.find_spec("memray") is None:
        spec = importlib.machinery.PathFinder.find_spec("memray", [extra])
        if spec is not None:
            mod = importlib.util.module_from_spec(spec)
            sys.modules["memray"] = mod
            spec.loader.exec_module(mod)
    import memray
    return memray


def _idle() -> None:
    while True:
        time.sleep(60)


def _watch(d: str, proc: str) -> None:
    t0 = time.monotonic()
    while True:  # vLLM names its worker after start-up: wait for the name (or give up in another process)
        try:
            with open("/proc/self/comm") as f:
                if f.read().strip().startswith(proc):
                    break
        except OSError:
            return _idle()
        if time.monotonic() - t0 > 900:  # not the process watched
            return _idle()
        time.sleep(1)
    pid = os.getpid()
    while not os.path.exists(os.path.join(d, "START")):
        time.sleep(1)
    try:
        memray = import_memray()
        tracker = memray.Tracker(os.path.join(d, f"memray-{pid}.bin"), native_traces=False,
                                 trace_python_allocators=False)
        tracker.__enter__()
    except Exception as e:  # noqa: BLE001 - reported in a file; the server goes on unwatched
        with open(os.path.join(d, f"error-{pid}"), "w") as f:
            f.write(f"{type(e).__name__}: {e}\n")
        return _idle()
    while not os.path.exists(os.path.join(d, "STOP")):
        time.sleep(1)
    tracker.__exit__(None, None, None)
    open(os.path.join(d, f"done-{pid}"), "w").close()
    _idle()


if _DIR:
    threading.Thread(target=_watch, args=(_DIR, os.environ.get("TIERKV_HEAP_WATCH_PROC", "VLLM::Worker")),
                     name="heap-watch", daemon=True).start()
