"""Bytes each tier wrote and served, and the warning about a tier that only writes.

From the scheduler side's counters (one engine, every rank): L2 wrote the pages saved L1 -> L2 (``save_pages``) and
served the tokens loaded L2 -> L1 (``l2_hit_tokens``); L3 wrote the pages every rank confirmed stored
(``ctl_backup_stored_pages``) and served the tokens loaded from it (``ctl_l3_hit_tokens``). Bytes = pages x a page's
bytes on every rank (tokens x that / page size). :meth:`TierBytes.add_to` puts ``l2_written_bytes``,
``l2_served_bytes``, ``l3_written_bytes`` and ``l3_served_bytes`` into a stats snapshot and logs a warning, per tier
at most once per :data:`WARN_EVERY_S`, while the tier wrote more than ``controller.write_only_warn_bytes`` and served
under :data:`SERVED_FRACTION` of it, naming what to change. Clock: monotonic seconds, injectable.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

logger = logging.getLogger("tierkv.tiers")

#: a tier that served less than this share of the bytes it wrote is warned about
SERVED_FRACTION = 0.01
#: seconds between two warnings about one tier
WARN_EVERY_S = 3600.0

#: tier -> what to change when it only writes
ADVICE = {
    "L2": "prompts rarely repeat a prefix while L2 still holds it: give L2 more room (host_pool.size_gb) if they "
          "repeat later, or save only each request's shared prefix (kv_transfer_params tierkv.save_max_tokens)",
    "L3": "most pages written to L3 are never read back: write only reused pages (l3.admission: second_sight or "
          "reused_in_l2), give L2 more room (host_pool.size_gb), or turn L3 off (l3.backend: none)",
}


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - unreachable


class TierBytes:
    """Per-tier bytes written and served, and the write-only warning (see the module docstring).

    Args:
        l2_page_bytes / l3_page_bytes: bytes of one page in L2 / in L3, every rank together (MLA: one record).
        page_size: tokens per page.
        warn_bytes: ``controller.write_only_warn_bytes``; 0 = never warn.
        clock: monotonic seconds (a freshly booted machine's starts near 0: "never warned" is None, not 0).
    """

    def __init__(self, l2_page_bytes: int, l3_page_bytes: int, page_size: int, warn_bytes: int = 1 << 30,
                 clock: Callable[[], float] = time.monotonic):
        self.page_bytes = {"L2": l2_page_bytes, "L3": l3_page_bytes}
        self.page_size = page_size
        self.warn_bytes = warn_bytes
        self.clock = clock
        self.warned_at: dict[str, Optional[float]] = {"L2": None, "L3": None}
        self.warnings = 0

    def tiers(self, stats: dict) -> dict[str, tuple[int, int]]:
        """``{tier: (bytes written, bytes served)}`` from a scheduler stats snapshot; L3 only with a controller."""
        pb, ps = self.page_bytes, self.page_size
        out = {"L2": (stats.get("save_pages", 0) * pb["L2"], stats.get("l2_hit_tokens", 0) * pb["L2"] // ps)}
        if "ctl_backup_stored_pages" in stats:
            out["L3"] = (stats["ctl_backup_stored_pages"] * pb["L3"], stats.get("ctl_l3_hit_tokens", 0) * pb["L3"] // ps)
        return out

    def add_to(self, stats: dict) -> None:
        """Add the per-tier byte counters to ``stats`` and warn about a tier that only writes."""
        for tier, (written, served) in self.tiers(stats).items():
            t = tier.lower()
            stats[f"{t}_written_bytes"] = written
            stats[f"{t}_served_bytes"] = served
            self.check(tier, written, served)

    def check(self, tier: str, written: int, served: int) -> bool:
        """Warn (returns True) when ``tier`` wrote more than ``warn_bytes`` and served under
        :data:`SERVED_FRACTION` of it, unless it was warned about less than :data:`WARN_EVERY_S` ago."""
        if not self.warn_bytes or written <= self.warn_bytes or served >= SERVED_FRACTION * written:
            return False
        now = self.clock()
        last = self.warned_at[tier]
        if last is not None and now - last < WARN_EVERY_S:
            return False
        self.warned_at[tier] = now
        self.warnings += 1
        logger.warning("tierkv: %s wrote %s and served %s (%.2f %%) since start-up: %s (this warning: "
                       "controller.write_only_warn_bytes, 0 = off)", tier, _human(written), _human(served),
                       100.0 * served / written, ADVICE[tier])
        return True
