"""AMX tile permission (connector/cpu/cpu_features.py): asked where the CPU has AMX, never elsewhere."""
import subprocess
import sys

from tierkv.connector.cpu import cpu_features as cf

CPUINFO = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx2 amx_bf16 amx_tile amx_int8\n\n"


def test_flags_are_read_from_cpuinfo_text():
    assert cf.has_amx(cf.cpu_flags(CPUINFO))
    assert not cf.has_amx(cf.cpu_flags(CPUINFO.replace(" amx_tile", "")))
    assert cf.cpu_flags("no flags here") == set()


def test_no_amx_means_nothing_is_asked(monkeypatch):
    called = []
    monkeypatch.setattr(cf.ctypes, "CDLL", lambda *a, **k: called.append(a))
    assert cf.request_amx_permission(set(cf.cpu_flags(CPUINFO)) - {"amx_tile"}) is None
    assert called == []


def test_this_host_holds_the_permission_after_the_call_exactly_where_it_has_amx():
    """In a fresh process (the permission is per process): on an AMX host the call returns True and the kernel then
    reports XTILEDATA as permitted; on a host without AMX nothing is asked and nothing changes."""
    code = ("from tierkv.connector.cpu import cpu_features as cf; before = cf.amx_permitted(); "
            "r = cf.request_amx_permission(); print(cf.has_amx(), before, r, cf.amx_permitted())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    amx, before, got, after = out
    if amx == "True":
        assert (got, after) == ("True", "True")
    else:
        assert got == "None" and after == before
