"""The memory allocator of the vLLM CPU processes tierkv's tools start (``make demo``, the serving benchmarks).

vLLM's CPU worker asks for TCMalloc to be preloaded (it warns at start-up without it) and its install guide sets
``LD_PRELOAD``. With the C library's malloc, the engine's per-step tensors of a few MiB come from the main heap,
whose top is handed back to the kernel and mapped again by page faults, as much or as little as the process's heap
layout happens to allow: an effect fixed for the life of an engine process, which repeats inside one process cannot
average out (measured in benchmarks/README.md, ``## no_reuse_cost``, ``### tcmalloc``). So every engine a
comparison starts gets the same allocator: :func:`preload_env`.
"""
from __future__ import annotations

import subprocess
from typing import Optional

__all__ = ["ALLOCATORS", "TCMALLOC_NAMES", "tcmalloc_path", "preload_env"]

#: allowed values of an ``--allocator`` option: TCMalloc preloaded, or the C library's malloc
ALLOCATORS = ("tcmalloc", "glibc")
#: shared-library names looked up, in order (Debian's ``libtcmalloc-minimal4``, which ``.ci/setup_env.sh`` installs,
#: then the full gperftools library)
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")


def tcmalloc_path(ldconfig_text: Optional[str] = None) -> Optional[str]:
    """Path of TCMalloc's shared library (one of :data:`TCMALLOC_NAMES`) from the dynamic linker's cache
    (``ldconfig -p``, or ``ldconfig_text``), else None."""
    out = ldconfig_text
    if out is None:
        try:
            out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
    for name in TCMALLOC_NAMES:
        for line in out.splitlines():
            if line.strip().startswith(name + " ") and "=>" in line:
                return line.split("=>", 1)[1].strip()
    return None


def preload_env(allocator: str) -> dict:
    """Environment entries that make a vLLM process (and its children) use ``allocator``: ``tcmalloc`` ->
    ``{"LD_PRELOAD": <tcmalloc_path()>}``, ``glibc`` -> ``{}``.

    Raises ValueError for an allocator not in :data:`ALLOCATORS` (the message names the allowed values) and
    RuntimeError when TCMalloc is asked for and not installed (the message says how to install it)."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator {allocator!r}; allowed: {', '.join(ALLOCATORS)}")
    if allocator == "glibc":
        return {}
    path = tcmalloc_path()
    if path is None:
        raise RuntimeError("--allocator tcmalloc: libtcmalloc_minimal.so.4 is not installed (make venv installs "
                           "Debian's libtcmalloc-minimal4); pass --allocator glibc to run without it")
    return {"LD_PRELOAD": path}
