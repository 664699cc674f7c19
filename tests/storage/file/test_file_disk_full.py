"""File store on a full disk (capacity by LRU eviction, a filesystem that fills first) and on a directory it cannot
write.

The small filesystem is a real 8 MiB tmpfs (the tests run as root). Where mounting is not permitted
(``EPERM`` in an unprivileged container), the fixture falls back to an emulated 8 MiB quota: ``os.writev`` and
``os.write`` raise ``ENOSPC`` when the bytes already in the directory plus the write would exceed 8 MiB, which
exercises the same code path, but not the kernel's partial-write behaviour; the fallback is reported in the test
output. ``TIERKV_TEST_NO_MOUNT=1`` forces the fallback.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import subprocess
from collections import OrderedDict

import pytest
import torch

import tierkv.storage_backends.file.store as file_mod
from tierkv.connector.core.config import ConfigError
from tierkv.storage_backends.file.store import FileStore
from tierkv.storage_backends.page_format import HEADER_BYTES

MiB = 1 << 20
PAGE = 256 * 1024
REC = HEADER_BYTES + PAGE
NS = bytes(range(16))


def _dir_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


@contextlib.contextmanager
def small_fs(path, size_mib: int, monkeypatch):
    """An ``size_mib`` filesystem at ``path``: a tmpfs mount, or an emulated quota when mount is not allowed."""
    path.mkdir()
    if os.environ.get("TIERKV_TEST_NO_MOUNT"):  # exercise the fallback
        r = subprocess.CompletedProcess([], 1, "", "TIERKV_TEST_NO_MOUNT set")
    else:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)],
                           capture_output=True, text=True)
    if r.returncode == 0:
        try:
            yield "tmpfs"
        finally:
            subprocess.run(["umount", "-l", str(path)], check=False)
        return
    print(f"mount failed ({r.stderr.strip()}): emulating a {size_mib} MiB quota")
    limit = size_mib * MiB
    real_writev, real_write = os.writev, os.write

    def quota(n):
        if _dir_bytes(str(path)) + n > limit:
            raise OSError(errno.ENOSPC, "No space left on device (emulated)")

    monkeypatch.setattr(file_mod.os, "writev", lambda fd, bufs: (quota(sum(len(memoryview(b).cast("B"))
                                                                            for b in bufs)), real_writev(fd, bufs))[1])
    monkeypatch.setattr(file_mod.os, "write", lambda fd, b: (quota(len(b)), real_write(fd, b))[1])
    yield "emulated"


def page(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=g)


def files(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if "quarantine" not in d]


def assert_clean(root: str) -> None:
    """No temporary, zero-length or partial page files."""
    for f in files(root):
        name = os.path.basename(f)
        assert not name.startswith(".tmp."), f"temp file left: {f}"
        assert name.endswith(".page") and os.path.getsize(f) == REC, f"partial page file {f}"


def test_capacity_enforced_by_lru_eviction(tmp_path, monkeypatch):
    mnt = tmp_path / "mnt"
    with small_fs(mnt, 8, monkeypatch):
        root = str(mnt / "l3")
        s = FileStore(NS, PAGE, root=root, capacity_bytes="6MiB")
        cap_pages = (6 * MiB) // REC
        assert cap_pages == 23  # 24 payloads of 256 KiB, minus room for the 64-byte headers
        model: OrderedDict[str, int] = OrderedDict()  # expected LRU order: key -> page seed
        evicted: list[str] = []
        rng = random.Random(0)
        for i in range(200):
            k = f"{i:032x}"
            assert s.batch_set([k], [page(i)]) == [True]
            model[k] = i
            while len(model) > cap_pages:
                evicted.append(model.popitem(last=False)[0])
            assert s.take_evicted() == (evicted, 0)  # exactly this write's victims, then nothing more
            evicted = []
            assert s.stats()["usage_pages"] <= 24
            assert len(files(root)) <= 24
            if i % 10 == 9:
                rk = rng.choice(list(model))
                dst = torch.empty(PAGE, dtype=torch.uint8)
                assert s.batch_get([rk], [dst]) == [True]
                assert torch.equal(dst, page(model[rk]))
                model.move_to_end(rk)
        present = {os.path.basename(f)[:-5] for f in files(root)}
        assert present == set(model)  # exactly the least recently used ones were evicted
        assert s.stats()["enospc"] == 0 and s.stats()["evictions"] == 200 - cap_pages
        assert_clean(root)


def test_filesystem_fills_before_capacity(tmp_path, monkeypatch):
    mnt = tmp_path / "mnt"
    with small_fs(mnt, 8, monkeypatch) as kind:
        root = str(mnt / "l3")
        s = FileStore(NS, PAGE, root=root, capacity_bytes="16MiB", enospc_evict_pages=4)
        results = []
        for i in range(200):
            k = f"{i:032x}"
            r = s.batch_set([k], [page(i)])[0]
            results.append(r)
            assert_clean(root)
            if not r:
                assert s.batch_exists([k]) == 0  # a failed page is not visible
            if i % 10 == 9:  # gets keep working: every page on disk reads back exactly
                for f in files(root):
                    key = os.path.basename(f)[:-5]
                    dst = torch.empty(PAGE, dtype=torch.uint8)
                    assert s.batch_get([key], [dst]) == [True]
                    assert torch.equal(dst, page(int(key, 16)))
        st = s.stats()
        print(f"{kind}: stored {sum(results)}/200, enospc {st['enospc']}, forced evictions "
              f"{st['forced_evictions']}, usage {st['usage_pages']} pages")
        assert st["enospc"] > 0 and st["forced_evictions"] > 0  # the filesystem, not the capacity, ran out
        assert all(results[-20:])  # later stores succeed
        assert st["usage_pages"] == len(files(root)) < 16 * MiB // REC
        assert_clean(root)


def test_full_disk_filled_by_another_tenant(tmp_path, monkeypatch):
    """Something else filled the filesystem: a store with nothing to evict fails the set cleanly (False, nothing
    left behind); a store with pages evicts its own and the retry succeeds; gets keep working."""
    mnt = tmp_path / "mnt"
    with small_fs(mnt, 8, monkeypatch) as kind:
        root, lonely_root = str(mnt / "l3"), str(mnt / "l3b")
        s = FileStore(NS, PAGE, root=root, capacity_bytes="16MiB")
        lonely = FileStore(bytes(range(16, 32)), PAGE, root=lonely_root, capacity_bytes="16MiB")
        assert s.batch_set(["aa" * 16], [page(1)]) == [True]
        with open(mnt / "filler", "wb", buffering=0) as f:  # fill the rest of the filesystem
            if kind == "tmpfs":
                with contextlib.suppress(OSError):
                    while True:
                        f.write(b"\0" * 4096)
            else:
                f.write(b"\0" * (8 * MiB - _dir_bytes(str(mnt))))
        assert lonely.batch_set(["cc" * 16], [page(3)]) == [False]
        assert lonely.batch_exists(["cc" * 16]) == 0
        assert lonely.stats()["enospc"] == 1 and lonely.stats()["set_failures"] == 1
        assert not [f for f in files(lonely_root) if f.endswith(".page") or ".tmp." in f]
        # s evicts its own page to make room, then stores
        assert s.batch_set(["bb" * 16], [page(2)]) == [True]
        assert s.stats()["forced_evictions"] == 1 and s.batch_exists(["aa" * 16]) == 0
        assert s.take_evicted() == (["aa" * 16], 0)  # the forced eviction is named like any other
        assert s.take_evicted() == ([], 0)
        dst = torch.empty(PAGE, dtype=torch.uint8)
        assert s.batch_get(["bb" * 16], [dst]) == [True] and torch.equal(dst, page(2))
        assert_clean(root)


def test_unwritable_root_is_a_config_error(tmp_path, monkeypatch):
    not_dir = tmp_path / "a_file"
    not_dir.write_text("x")
    with pytest.raises(ConfigError, match=r"l3\.file\.root"):
        FileStore(NS, 4096, root=str(not_dir))
    with pytest.raises(ConfigError, match=r"l3\.file\.root"):
        FileStore(NS, 4096, root=str(not_dir / "sub"))

    # a directory that exists but refuses new files (as for a non-root user without write permission)
    d = tmp_path / "ro"
    d.mkdir()
    real_open = os.open

    def refuse(path, flags, *a, **kw):
        if str(path).startswith(str(d)) and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(file_mod.os, "open", refuse)
    with pytest.raises(ConfigError, match="read_only"):
        FileStore(NS, 4096, root=str(d))
    # read_only opens it for reads
    ro = FileStore(NS, 4096, root=str(d), read_only=True)
    assert ro.batch_set(["ab" * 16], [bytes(4096)]) == [False]
    assert ro.batch_exists(["ab" * 16]) == 0


_RO_CHECK = """
import sys
from tierkv.connector.core.config import ConfigError
from tierkv.storage_backends.file.store import FileStore
root = sys.argv[1]
try:
    FileStore(bytes(range(16)), 4096, root=root)
except ConfigError as e:
    print("CONFIG_ERROR:", e)
else:
    print("OPENED read-write")
ro = FileStore(bytes(range(16)), 4096, root=root, read_only=True)  # read_only opens it for reads
print("READ_ONLY_SET:", ro.batch_set(["ab" * 16], [bytes(4096)]), ro.batch_exists(["ab" * 16]))
"""


def test_read_only_mount_is_a_config_error(tmp_path):
    """A root on a real read-only filesystem (a tmpfs mounted ``ro``): the store refuses to start unless
    ``read_only``. The mount is made in a private mount namespace (``unshare -m``; as a non-root user also a user
    namespace, ``-r``), so it needs no cleanup and cannot leak; where neither is permitted the test fails."""
    import sys

    d = tmp_path / "romnt"
    d.mkdir()
    flags = ["-m"] if os.geteuid() == 0 else ["-r", "-m"]
    script = 'mount -t tmpfs -o ro,size=1m tmpfs "$1" || exit 97; exec "$2" -c "$3" "$1"'
    r = subprocess.run(["unshare", *flags, "sh", "-c", script, "sh", str(d), sys.executable, _RO_CHECK],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 97, f"cannot mount a read-only tmpfs here (needs root or user namespaces): {r.stderr}"
    assert r.returncode == 0, f"the check on the read-only mount failed: {r.stderr[-3000:]}"
    lines = r.stdout.splitlines()
    assert lines[0].startswith("CONFIG_ERROR:") and "l3.file.root" in lines[0], r.stdout
    assert lines[1] == "READ_ONLY_SET: [False] 0", r.stdout


def test_write_errors_at_run_time_are_per_key_failures(tmp_path, monkeypatch, caplog):
    s = FileStore(NS, 4096, root=str(tmp_path / "l3"))
    assert s.batch_set(["01" * 16], [bytes(range(256)) * 16]) == [True]
    real_rename = os.rename
    monkeypatch.setattr(file_mod.os, "rename",
                        lambda a, b: (_ for _ in ()).throw(OSError(errno.EROFS, "Read-only file system")))
    with caplog.at_level(logging.WARNING, logger="tierkv.storage.file"):
        assert s.batch_set(["02" * 16, "03" * 16], [bytes(4096)] * 2) == [False, False]
    assert "Read-only file system" in caplog.text
    monkeypatch.setattr(file_mod.os, "rename", real_rename)
    assert s.batch_exists(["02" * 16]) == 0
    assert not [f for f in files(str(tmp_path / "l3")) if ".tmp." in f]
    st = s.stats()
    assert st["set_failures"] == 2 and st["errors"] == 2 and st["usage_pages"] == 1
    dst = bytearray(4096)
    assert s.batch_get(["01" * 16], [dst]) == [True] and bytes(dst) == bytes(range(256)) * 16
