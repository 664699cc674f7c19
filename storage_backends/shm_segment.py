"""One shared-memory segment helper for the stores that move pages through ``/dev/shm``: the ZMQ client's own segment
(:mod:`tierkv.storage_backends.zmq.client`, created here), the client segments the tierkv server maps (:mod:`tierkv.storage_backends.zmq.server`) and the LMCache
server's segment the LMCache store maps (:mod:`tierkv.storage_backends.lmcache.store`), and the tierkv server's presence table
(:mod:`tierkv.storage_backends.zmq.presence_table`). :func:`sweep_dead_files` removes such files left by killed processes.

A :class:`Segment` is a file mapped shared and read-write, seen as a flat ``memoryview`` (``mv``, format ``B``, ``size``
bytes). :meth:`Segment.create` makes a new file (exclusive, mode 0600) that only the creating process removes (on
:meth:`Segment.close`, when the object is collected, or at interpreter exit; a forked child never removes its parent's
file); :meth:`Segment.open` maps an existing one. :meth:`Segment.intact` tells whether the path still names the file
that was mapped (same device and inode), i.e. it was neither removed nor replaced.
"""
from __future__ import annotations

import mmap
import os
import re
import stat
import weakref
from typing import Optional

__all__ = ["Segment", "POPULATE", "sweep_dead_files"]

#: map flag that faults the pages in up front (Linux ``MAP_POPULATE``; 0 elsewhere), so the first calls through a fresh
#: segment do not pay a page fault per 4 KiB
POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _release(path: str, mm: mmap.mmap, owner_pid: Optional[int]) -> None:
    """Finalizer of a :class:`Segment`: unmap it, and remove its file in the process that created it."""
    try:
        mm.close()
    except BufferError:  # a view is still exported (interpreter shutdown): the mapping goes with the process
        pass
    if owner_pid is not None and os.getpid() == owner_pid:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class Segment:
    """A ``/dev/shm`` file mapped shared, read-write (read-only when opened so; see the module docstring).
    Attributes: ``path``, ``name`` (its base name), ``size`` (bytes mapped), ``mv`` (flat ``memoryview``), ``pid``
    (the creating process, or None for a segment opened with :meth:`open`)."""

    def __init__(self, path: str, fd: int, size: int, owner: bool, populate: bool, readonly: bool = False):
        st = os.fstat(fd)
        self.path, self.name, self.size = path, os.path.basename(path), size
        self.pid: Optional[int] = os.getpid() if owner else None
        self._ino = (st.st_dev, st.st_ino)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED | (POPULATE if populate else 0),
                       mmap.PROT_READ | (0 if readonly else mmap.PROT_WRITE))
        self.mv = memoryview(mm)
        self._fin = weakref.finalize(self, _release, path, mm, self.pid)

    @classmethod
    def create(cls, directory: str, name: str, size: int) -> "Segment":
        """Create ``directory/name`` (exclusively, mode 0600, not following a link) of ``size`` bytes and map it with
        its pages faulted in. The bytes are allocated first (``posix_fallocate``), so a full tmpfs (a container's
        small ``/dev/shm``) is ENOSPC here rather than SIGBUS at a later write into the mapping. Raises OSError
        (exists already, no space, no such directory); nothing is left behind."""
        path = os.path.join(directory, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            return cls(path, fd, size, owner=True, populate=True)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)

    @classmethod
    def open(cls, path: str, size: Optional[int], populate: bool = True, readonly: bool = False) -> "Segment":
        """Map the first ``size`` bytes (None: all of it) of the existing regular file ``path`` (not following a
        link); ``readonly``: opened and mapped for reading only (writes through ``mv`` raise TypeError).

        Raises:
            OSError: it cannot be opened or mapped.
            ValueError: it is not a regular file of at least ``size`` bytes (the message says what it is).
        """
        fd = os.open(path, (os.O_RDONLY if readonly else os.O_RDWR) | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            want = st.st_size if size is None else size
            if not stat.S_ISREG(st.st_mode) or st.st_size < want or want < 1:
                what = f"{st.st_size} bytes" if stat.S_ISREG(st.st_mode) else "not a regular file"
                raise ValueError(f"{path} is not a regular file of >= {max(want, 1)} bytes ({what})")
            return cls(path, fd, want, owner=False, populate=populate, readonly=readonly)
        finally:
            os.close(fd)

    def exists(self) -> bool:
        """The path exists (whatever file it names now)."""
        return os.path.exists(self.path)

    def intact(self) -> bool:
        """The path still names the file that was mapped (not removed, not replaced)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._ino

    def close(self) -> None:
        """Unmap (once no view of ``mv`` is left; until then the garbage collector does it) and, in the creating
        process, remove the file. Idempotent."""
        try:
            self.mv.release()
        except BufferError:  # a slot view is still referenced somewhere: the mapping goes when it is collected
            pass
        self._fin()


def sweep_dead_files(directory: str, name_re: re.Pattern, pid_at: int) -> int:
    """Remove this user's files in ``directory`` whose names match ``name_re`` and whose creating process is gone
    (a process killed by SIGKILL leaves its file behind). The creator's pid is the 8 hex digits at ``pid_at`` of the
    name. A file of another user, or of a process that is alive or not ours to signal, stays. Returns files removed."""
    n = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    uid = os.getuid()
    for name in names:
        if not name_re.match(name):
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path, follow_symlinks=False).st_uid != uid:
                continue
            os.kill(int(name[pid_at:pid_at + 8], 16), 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
                n += 1
            except OSError:
                pass
        except (OSError, ValueError):  # alive but not ours to signal, or vanished meanwhile
            continue
    return n
