"""A vLLM KV connector that does nothing: the reference for what vLLM's own connector path costs.

With any ``kv_transfer_config`` vLLM runs its connector machinery every step (the scheduler builds connector
metadata and asks for matches, the worker binds the metadata and calls the forward hooks, the worker's connector
output travels back to the engine core). This connector answers "no external tokens" for every request, plans no
load or save and keeps no state, so a server with it differs from one without a connector only by that machinery.
``benchmarks/serve_cpu`` runs it as the configuration ``noop_connector`` (same L1 as ``none``) to separate
vLLM's per-step connector cost from tierkv's own work on workloads where tierkv cannot help (``random``).

Loaded by vLLM through ``kv_connector_module_path: noop_connector`` with ``benchmarks/`` on the server's
``PYTHONPATH``; not part of the tierkv package.
"""
from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class NoopMetadata(KVConnectorMetadata):
    """Empty per-step plan (vLLM pickles one to the worker every step)."""


class NoopConnector(KVConnectorBase_V1):
    """Every hook returns at once: 0 matched tokens, no load, no save, nothing to report."""

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return NoopMetadata()

    # worker side
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
