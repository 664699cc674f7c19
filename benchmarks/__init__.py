"""tierkv's benchmarks: each a module run from the repository root as ``python -m benchmarks.<name>``.

What every benchmark shares (servers, stats, results, the machine record) is in :mod:`benchmarks.harness`;
``benchmarks/README.md`` says what each measures and holds the current table of each claim.
"""
