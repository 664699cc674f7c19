"""tierkv: hierarchical KV cache for LLM serving engines.

Sub-packages (installed from the repository's top-level folders):

- ``tierkv.connector``: config, page keys, radix prefix index, host pool (L2), device pool adapter (L1),
  controller, and the vLLM v1 connector (``tierkv.connector.vllm.connector``, the only module importing vLLM).
- ``tierkv.storage_backends``: L3 stores (file, zmq, mooncake) behind one interface.
- ``tierkv.kernels``: page transfer kernels between L1 and L2 (torch on CPU, Triton on CUDA).
- ``tierkv.configs``: shipped YAML configs.
"""

__version__ = "0.1.0"
