"""Deprecated import path, kept for SGLang's ``dynamic`` storage backend (``module_path``): use
``tierkv.connector.sglang.hicache``.

Importing it warns (DeprecationWarning) and hands back the module at the new path itself."""
import sys
import warnings

import tierkv.connector.sglang.hicache as _module

warnings.warn("tierkv.connector.sglang_hicache is deprecated; use tierkv.connector.sglang.hicache",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
