"""The file store names the filesystem its root is on, and warns once when it is ext4 without a journal (whose inode
allocator skips recently deleted inodes: creating records gets slow after many deletions)."""
import logging
import os

from tierkv.storage_backends.file import store as file_mod
from tierkv.storage_backends.file.store import FileStore, mount_of

NS = bytes(range(16))


def _mounts(tmp_path, lines):
    p = tmp_path / "mounts"
    p.write_text("".join(line + "\n" for line in lines))
    j = tmp_path / "jbd2"
    j.mkdir()
    (j / "loop0-8").mkdir()
    return str(p), str(j)


def test_the_longest_mount_point_above_the_path_is_the_filesystem(tmp_path):
    mounts, jbd2 = _mounts(tmp_path, [
        "/dev/vda / ext4 rw,relatime,discard 0 0",
        "/dev/loop0 /mnt/img ext4 rw,relatime 0 0",
        "tmpfs /mnt/img/shm tmpfs rw 0 0",
        "/dev/loop1 /mnt/im ext4 rw 0 0",          # a prefix of /mnt/img as a string, not as a path
    ])
    root = mount_of("/srv/l3", mounts, jbd2)
    assert (root["device"], root["mount"], root["fstype"], root["journal"]) == ("/dev/vda", "/", "ext4", False)
    img = mount_of("/mnt/img/l3/ns", mounts, jbd2)
    assert (img["device"], img["mount"], img["journal"]) == ("/dev/loop0", "/mnt/img", True)
    assert mount_of("/mnt/img", mounts, jbd2)["mount"] == "/mnt/img"
    assert mount_of("/mnt/img/shm/x", mounts, jbd2)["journal"] is None        # not ext4: no opinion
    assert mount_of("/x", str(tmp_path / "missing"), jbd2) == {}


def test_ext4_without_a_journal_is_named_once_per_mount(tmp_path, monkeypatch, caplog):
    info = {"device": "/dev/vdz", "mount": str(tmp_path), "fstype": "ext4", "options": "rw", "journal": False}
    monkeypatch.setattr(file_mod, "mount_of", lambda path: dict(info))
    monkeypatch.setattr(file_mod, "_NO_JOURNAL_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="tierkv.storage.file"):
        a = FileStore(NS, 4096, root=str(tmp_path / "a"))
        b = FileStore(NS, 4096, root=str(tmp_path / "b"))
    said = [r.getMessage() for r in caplog.records if "without a journal" in r.getMessage()]
    assert len(said) == 1 and "/dev/vdz" in said[0]
    assert a.filesystem == info and b.filesystem == info
    a.close()
    b.close()


def test_a_journaled_filesystem_gets_no_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(file_mod, "mount_of", lambda path: {"device": "/dev/loop0", "mount": str(tmp_path),
                                                            "fstype": "ext4", "options": "rw", "journal": True})
    monkeypatch.setattr(file_mod, "_NO_JOURNAL_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="tierkv.storage.file"):
        FileStore(NS, 4096, root=str(tmp_path / "a")).close()
    assert "without a journal" not in caplog.text


def test_this_machines_store_root_is_described(tmp_path):
    st = FileStore(NS, 4096, root=str(tmp_path))
    assert st.filesystem["mount"] and os.path.realpath(str(tmp_path)).startswith(st.filesystem["mount"].rstrip("/"))
    st.close()
