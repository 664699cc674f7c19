"""``benchmarks/mla_l3_bytes.py``: MLA pages under TP stored once vs per rank, through the workers' L3 path (real MLA
host pools, L3IO and file stores), and the README table of the committed result."""
import json

from benchmarks import mla_l3_bytes as bench
from benchmarks.harness import REPO

TOKEN_BYTES = 2 * 576 * 2   # 2 layers x 576 bf16 latent values


def test_once_stores_one_record_per_page_and_per_rank_tp_copies(tmp_path):
    got = {s: bench.run_case(2, 2, 16, s, 3, tmp_path / s) for s in bench.SCHEMES}
    once, per_rank, all_write = got["once"], got["per_rank"], got["all_ranks_write"]
    assert once["page_bytes"] == 16 * TOKEN_BYTES
    assert (once["records"], once["sets"], once["reads"]) == (3, 3, 6)
    assert once["disk_bytes_per_token"] == (16 * TOKEN_BYTES + 64) / 16
    assert once["written_bytes_per_token"] == TOKEN_BYTES
    assert (per_rank["records"], per_rank["sets"]) == (6, 6)
    assert per_rank["disk_bytes_per_token"] == 2 * once["disk_bytes_per_token"]
    assert (all_write["records"], all_write["sets"]) == (3, 6)
    assert all_write["disk_bytes_per_token"] == once["disk_bytes_per_token"]
    assert all_write["written_bytes_per_token"] == 2 * TOKEN_BYTES


def test_the_committed_result_renders_once_against_per_rank():
    data = json.loads((REPO / "benchmarks" / "results" / "mla_l3_bytes.json").read_text())
    row = next(r for r in data["rows"] if r["scheme"] == "once" and r["tp"] == 2)
    per_rank = next(r for r in data["rows"] if r["scheme"] == "per_rank" and r["tp"] == 2
                    and (r["model"], r["page_size"]) == (row["model"], row["page_size"]))
    assert per_rank["disk_bytes_per_token"] == 2 * row["disk_bytes_per_token"]
    assert f"| {row['disk_bytes_per_token']:,.0f} | {per_rank['disk_bytes_per_token']:,.0f} |" in bench.section(data)
