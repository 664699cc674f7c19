"""The machine a result was measured on: what every result file records next to its numbers.

:func:`machine` -> ``{"cpu": lscpu model name, "cpus": cores, "flags": lscpu flags, "isa": the vector ISA in words,
"load": 1/5/15-minute load average}``; a value lscpu cannot give is ``"?"`` (or ``[]`` for the flags).
"""
from __future__ import annotations

import os
import subprocess

#: the flags that decide how fast vLLM's CPU backend and tierkv's copies run, in the order the README names them
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def _lscpu() -> dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in out.splitlines()) if v}


def cpu_model() -> str:
    """lscpu's ``Model name``, or ``?`` without lscpu."""
    return _lscpu().get("Model name", "?")


def lscpu_flags() -> list[str]:
    """lscpu's ``Flags`` (the CPU's feature flags), falling back to ``/proc/cpuinfo``; [] if neither answers."""
    flags = _lscpu().get("Flags", "").split()
    if flags:
        return flags
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return []


def isa(flags: list[str] | None = None) -> str:
    """``has avx2, avx512f, ...`` for the :data:`ISA_FLAGS` among ``flags`` (default: this machine's)."""
    flags = lscpu_flags() if flags is None else flags
    have = [f for f in ISA_FLAGS if f in flags]
    return "has " + ", ".join(have) if have else "no AVX2/AVX-512/AMX"


def loadavg() -> list[float]:
    """The 1, 5 and 15-minute load averages, rounded to 0.01."""
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict:
    """What a result records of the machine (see the module docstring)."""
    flags = lscpu_flags()
    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "flags": flags, "isa": isa(flags), "load": loadavg()}
