"""Serving benchmark: vLLM's OpenAI server on the CPU backend with and without tierkv, driven by vLLM's own
``vllm bench serve`` client under concurrent load. Run ``python -m benchmarks.serve_cpu`` (``--help``).

Modules: :mod:`.configs` (configurations, sizes, environments), :mod:`.client` (the client runs), :mod:`.passes`
(servers and runs of a pass), :mod:`.soak` (the soak and its checks), :mod:`.report` (tables and chart),
``__main__`` (the command line).
"""
