"""CPU seconds, threads and resident memory of a process tree, read from ``/proc`` (Linux).

CPU seconds are user + system; keys are ``<name>:<pid>`` for a process and ``<name>:<pid>/<thread name>`` for the
group of its threads with one kernel name (tierkv names its threads ``tkv-...``). A process or thread that ends
while being read is left out, never an error.
"""
from __future__ import annotations

import os
import resource
from pathlib import Path


def _proc_status(pid: int) -> dict:
    out = {}
    try:
        for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = ln.partition(":")
            if k in ("Name", "Threads", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[k] = v.strip()
    except OSError:
        return {}
    kib = lambda k: int(out.get(k, "0 kB").split()[0])
    return {"name": out.get("Name"), "threads": int(out.get("Threads", 0)), "rss_kib": kib("VmRSS"),
            "rss_anon_kib": kib("RssAnon"), "rss_file_kib": kib("RssFile"), "rss_shmem_kib": kib("RssShmem")}


def parent_pids() -> dict[int, int]:
    """``{pid: parent pid}`` of every process now in ``/proc`` (one that ends while being read is left out)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return parent


def tree_of(root: int, parent: dict[int, int]) -> list[int]:
    """``root`` and its descendants under the ``{pid: parent pid}`` map ``parent``, root first, each once."""
    out, todo, seen = [root], [root], {root}
    while todo:
        p = todo.pop()
        kids = sorted(c for c, pp in parent.items() if pp == p and c not in seen)
        seen.update(kids)
        out += kids
        todo += kids
    return out


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants (by the parent PID in /proc/<pid>/stat), root first."""
    return tree_of(root, parent_pids())


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_of(stat_path: str) -> tuple[str, float]:
    """(name, user + system CPU seconds) from a ``/proc/.../stat`` file. Raises OSError or ValueError if it went."""
    with open(stat_path) as f:
        stat = f.read()
    fields = stat.rsplit(")", 1)[1].split()
    return stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / _TICK  # fields 14, 15


def cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each process of ``root``'s tree, keyed ``<name>:<pid>``, and by
    each group of its threads with one kernel name, keyed ``<name>:<pid>/<thread name>`` (tierkv names its threads
    ``tkv-...``: :mod:`tierkv.connector.obs.thread_names`). A process or thread that ends while being read is left out."""
    out: dict[str, float] = {}
    for pid in process_tree(root):
        try:
            name, total = _cpu_of(f"/proc/{pid}/stat")
            tids = os.listdir(f"/proc/{pid}/task")
        except (OSError, ValueError):
            continue
        proc = f"{name}:{pid}"
        out[proc] = total
        for tid in tids:
            try:
                tname, t = _cpu_of(f"/proc/{pid}/task/{tid}/stat")
            except (OSError, ValueError):
                continue
            out[f"{proc}/{tname}"] = out.get(f"{proc}/{tname}", 0.0) + t
    return out


def machine_cpu_seconds() -> float:
    """CPU seconds the whole machine has been busy since boot, all CPUs together: user + nice + system + irq +
    softirq of ``/proc/stat``'s first line (idle, iowait and steal left out). Its difference over a run, less the
    server's, the ``tierkv server``'s and the client's, is what ran elsewhere: the kernel's own threads (writeback of
    dirty pages among them), other processes, this driver."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[1:8])
    return (user + nice + system + irq + softirq) / _TICK


def children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's waited-for children so far (``RUSAGE_CHILDREN``); over one
    client run it is the client's, the only child waited meanwhile."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def cpu_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """CPU seconds between two :func:`cpu_seconds` snapshots (keys in ``after``; a thread group that is new counts
    from 0), plus ``total`` over the processes. Groups that used under 0.01 s are left out."""
    d = {k: round(v - before.get(k, 0.0), 2) for k, v in after.items()}
    d = {k: v for k, v in d.items() if v >= 0.01 or "/" not in k}
    d["total"] = round(sum(v for k, v in d.items() if "/" not in k), 2)
    return d


def thread_names(pid: int) -> dict[str, int]:
    """How many threads of ``pid`` carry each kernel name (read as :func:`cpu_seconds` reads them); {} if it
    went."""
    out: dict[str, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            name, _cpu = _cpu_of(f"/proc/{pid}/task/{tid}/stat")
        except (OSError, ValueError):
            continue
        out[name] = out.get(name, 0) + 1
    return out


def processes(root: int) -> dict[str, dict]:
    """Threads (their count and, in ``thread_names``, how many carry each name) and resident memory of ``root`` and
    every process under it, keyed ``<name>:<pid>``."""
    out = {}
    for pid in process_tree(root):
        st = _proc_status(pid)
        if st:
            st["thread_names"] = thread_names(pid)
            out[f"{st['name']}:{pid}"] = st
    return out


def thread_changes(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict[str, int]]:
    """Per process of ``before`` whose threads differ in ``after`` (both :func:`processes`), the change in
    the number of threads of each name (``{"<name>:<pid>": {"<thread name>": +n or -n}}``); processes recorded
    without names are left out."""
    out = {}
    for k, v in before.items():
        a, b = v.get("thread_names"), (after.get(k) or {}).get("thread_names")
        if a is None or b is None:
            continue
        d = {n: b.get(n, 0) - a.get(n, 0) for n in sorted(set(a) | set(b)) if b.get(n, 0) != a.get(n, 0)}
        if d:
            out[k] = d
    return out
