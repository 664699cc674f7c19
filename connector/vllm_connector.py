"""Deprecated import path, kept for vLLM's ``kv_connector_module_path``: use ``tierkv.connector.vllm.connector``.

Importing it warns (DeprecationWarning) and hands back the module at the new path itself."""
import sys
import warnings

import tierkv.connector.vllm.connector as _module

warnings.warn("tierkv.connector.vllm_connector is deprecated; use tierkv.connector.vllm.connector",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
