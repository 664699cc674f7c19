"""Deprecated import path, kept for vLLM's ``--logits-processors``: use ``tierkv.connector.vllm.params_check``.

Importing it warns (DeprecationWarning) and hands back the module at the new path itself."""
import sys
import warnings

import tierkv.connector.vllm.params_check as _module

warnings.warn("tierkv.connector.vllm_params_check is deprecated; use tierkv.connector.vllm.params_check",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
