"""The tests' default page namespace: one small bf16 model in the default host layout.

``make_namespace(**overrides)`` returns a :class:`ModelNamespace` with the defaults below (the fake engine's page
size and geometry: 32-token pages, 2 layers, 2 KV heads, head dim 8), any field replaced by a keyword argument.
Named ``make_*`` rather than ``test_*`` so that pytest never collects it from a test module that imports it.
"""
from __future__ import annotations

from tierkv.connector.core.page_hash import ModelNamespace

DEFAULTS = dict(model_id="m", dtype="bfloat16", kv_layout="layer_first/LBHNC", page_size=32, num_layers=2,
                num_kv_heads=2, head_dim=8)


def make_namespace(**overrides) -> ModelNamespace:
    """A :class:`ModelNamespace` of :data:`DEFAULTS` with ``overrides`` applied (any field, ``salt`` included)."""
    return ModelNamespace(**{**DEFAULTS, **overrides})


__all__ = ["DEFAULTS", "make_namespace"]
