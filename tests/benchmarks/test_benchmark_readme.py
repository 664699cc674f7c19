"""``benchmarks/README.md`` and ``benchmarks/results/`` stay within their budgets: one current table per claim, each
naming result files that exist, and no result file that no table names (a superseded run or variant is deleted;
git keeps it)."""
import itertools
import re

from benchmarks.harness import REPO, RESULTS

README = REPO / "benchmarks" / "README.md"
MAX_README_LINES = 400
MAX_RESULTS_BYTES = 2 * 1024 * 1024
#: a result file as the README names it: ``serve_cpu.json``, ``results/transfer_gbps.png``, ``run{1,2}.json``
_NAME = re.compile(r"(?<![\w$/<>.-])(?:benchmarks/)?(?:results/)?([\w{},-]+\.(?:json|png))\b")


def _expand(name: str) -> list[str]:
    """``a_{x,y}.json`` -> ``[a_x.json, a_y.json]`` (every brace group, in order)."""
    parts = re.split(r"\{([^}]*)\}", name)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def named_results(text: str) -> set[str]:
    """Every result file name in ``text``'s table rows, result paths and commands (brace groups expanded)."""
    return {n for m in _NAME.finditer(text) for n in _expand(m.group(1))}


def test_the_readme_fits_its_budget():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"benchmarks/README.md has {lines} lines (budget {MAX_README_LINES}): " \
        "replace a claim's table instead of adding one next to it"


def test_the_results_fit_their_budget():
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    biggest = sorted(files, key=lambda p: p.stat().st_size)[-3:]
    assert size <= MAX_RESULTS_BYTES, f"benchmarks/results/ holds {size:,} B (budget {MAX_RESULTS_BYTES:,}); " \
        f"largest: {', '.join(p.name for p in biggest)}"


def test_every_result_file_the_readme_names_exists_and_every_result_file_is_named():
    named = named_results(README.read_text())
    present = {p.name for p in RESULTS.iterdir() if p.is_file()}
    assert named - present == set(), "benchmarks/README.md names result files that do not exist"
    assert present - named == set(), "result files that no table of benchmarks/README.md names: delete them"


def test_names_are_found_in_tables_paths_and_brace_groups_and_not_in_placeholders():
    text = ("| x | `storage_lmcache_run{1,2}.json` | ![c](results/a_ttft.png) |\n"
            "--out benchmarks/results/b.json; $OUT/gpu_check.json; fleet_<l3>.json; docs/x.md\n")
    assert named_results(text) == {"storage_lmcache_run1.json", "storage_lmcache_run2.json", "a_ttft.png", "b.json"}


def test_the_tables_drawn_by_code_are_what_the_committed_results_give():
    """The serving and transfer tables are drawn by the benchmarks' own code from the files the README names: a new
    run's file must come with its table, and the table cannot drift from the file."""
    from benchmarks import tables
    from benchmarks.harness.results import load_result
    from benchmarks.serve_cpu import report

    text = README.read_text()
    assert report.headline_table(load_result(RESULTS / "serve_cpu_house_fp32.json")) in text
    assert tables.transfer() in text
