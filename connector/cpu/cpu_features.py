"""Permission for Intel AMX tile data, asked once per process where the CPU has AMX (field report in the issue
"Serving under concurrent load").

Linux gives a process the large AMX tile state (``XTILEDATA``) only after it asked with
``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``; an AMX instruction executed before that raises SIGILL.
vLLM's CPU attention kernels use AMX on such hosts and rely on something having asked first. On an engine whose
first request is an L3 hit (a restart) tierkv's load path was the first to reach that kernel, and the worker died
of SIGILL. The connector therefore asks in every process it starts in, before any page moves. Asking again is
harmless (the kernel answers success); a CPU without AMX is left alone.
"""
from __future__ import annotations

import ctypes
import logging
import platform
from typing import Optional

logger = logging.getLogger("tierkv.cpu")

SYS_ARCH_PRCTL = 158          # x86_64 syscall number of arch_prctl
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def cpu_flags(cpuinfo: Optional[str] = None) -> set[str]:
    """The ``flags`` of the first processor in ``/proc/cpuinfo`` (or in the text ``cpuinfo``); empty if unknown."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def has_amx(flags: Optional[set[str]] = None) -> bool:
    """Whether the CPU advertises AMX tiles (``amx_tile``)."""
    return "amx_tile" in (cpu_flags() if flags is None else flags)


def amx_permitted() -> Optional[bool]:
    """Whether this process may use AMX tile data now (``ARCH_GET_XCOMP_PERM``); None off Linux x86_64."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_uint64(0)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) != 0:
        return None
    return bool(mask.value & (1 << XFEATURE_XTILEDATA))


def request_amx_permission(flags: Optional[set[str]] = None) -> Optional[bool]:
    """Ask the kernel for AMX tile data permission for this process where the CPU has AMX.

    Returns None when the CPU has no AMX (nothing asked), True when the permission is held after the call, False when
    the kernel refused (logged as a warning: vLLM's AMX kernels would then die of SIGILL; the usual cause is a kernel
    older than Linux 5.16)."""
    if not has_amx(flags):
        return None
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if rc != 0:
        err = ctypes.get_errno()
        logger.warning("tierkv: the CPU has AMX but the kernel refused AMX tile permission (arch_prctl errno %d); "
                       "vLLM's AMX attention kernels may fail with SIGILL", err)
        return False
    return True
