"""Real vLLM configuration objects for in-process tests of :class:`TierKVConnector` (no engine, no model weights).

The model is a directory holding only a Llama ``config.json`` (vLLM's ``ModelConfig`` reads nothing else with
``skip_tokenizer_init``); the KV cache config is vLLM's own ``KVCacheConfig`` with one group of full-attention layers
(or several, for the hybrid-model start-up error); the worker's KV tensors are CPU tensors in vLLM's CPU-backend
shape ``[num_blocks, H, N, 2D]``.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from tierkv.connector.vllm.connector import TierKVConnector

BLOCK = 32
KV_HEADS, HEAD_DIM, NUM_LAYERS = 2, 8, 3
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
SCHEDULER, WORKER = KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER


def write_model(directory: Path) -> str:
    """A Llama config.json (3 layers, 2 KV heads of 8) in ``directory``; returns the path as str."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
        "num_attention_heads": 2, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "num_hidden_layers": NUM_LAYERS, "vocab_size": 256, "max_position_embeddings": 1024,
        "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}))
    return str(directory)


def vllm_config(model_dir: str, extra: Optional[dict] = None, *, block_size: int = BLOCK) -> VllmConfig:
    kt = KVTransferConfig(kv_connector="TierKVConnector", kv_connector_module_path="tierkv.connector.vllm.connector",
                          kv_role="kv_both", kv_connector_extra_config=dict(extra or {}))
    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024)
    return VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=block_size), kv_transfer_config=kt)


def kv_cache_config(num_blocks: int, groups: int = 1, *, block_size: int = BLOCK) -> KVCacheConfig:
    """``groups`` KV cache groups over the model's layers (one group: every layer; more: the layers dealt out)."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
    names = [LAYER_NAMES[g::groups] for g in range(groups)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(n, spec) for n in names])


def kv_caches(num_blocks: int) -> dict[str, torch.Tensor]:
    """Zeroed CPU KV tensors, one per layer, ``[num_blocks, H, N, 2D]`` bf16."""
    return {n: torch.zeros(num_blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16) for n in LAYER_NAMES}


def connector(model_dir: str, role, extra: Optional[dict] = None, *, num_blocks: int = 16, groups: int = 1,
              block_size: int = BLOCK, config: Optional[VllmConfig] = None) -> TierKVConnector:
    """A connector of ``role``; ``config`` (instead of ``model_dir``/``extra``/``block_size``): the VllmConfig of an
    engine whose other role was built already (both roles of one engine share its instance id)."""
    return TierKVConnector(config or vllm_config(model_dir, extra, block_size=block_size), role,
                           kv_cache_config(num_blocks, groups, block_size=block_size))


def worker_connector(model_dir: str, extra: Optional[dict] = None, *, num_blocks: int = 16,
                     config: Optional[VllmConfig] = None):
    """A worker-role connector with its KV tensors registered; returns (connector, tensors by layer)."""
    c = connector(model_dir, WORKER, extra, num_blocks=num_blocks, config=config)
    caches = kv_caches(num_blocks)
    c.register_kv_caches(caches)
    return c, caches


class TierkvLoggerState:
    """Saves and restores the ``tierkv`` logger (the connector routes it to vLLM's handlers, sets its level and turns
    propagation off, which would hide later tests' records from caplog)."""

    def __init__(self):
        self.log = logging.getLogger("tierkv")
        self.saved = (self.log.level, list(self.log.handlers), self.log.propagate)

    def restore(self) -> None:
        level, handlers, propagate = self.saved
        self.log.setLevel(level)
        self.log.handlers[:] = handlers
        self.log.propagate = propagate


def run_step(c, plan) -> set[int]:
    """One worker step as vLLM's model runner drives it: bind the plan, start loads, each attention layer waits for
    its own, wait_for_save, then the load errors of the step."""
    c.bind_connector_metadata(plan)
    c.start_load_kv(None)
    for name in LAYER_NAMES:
        c.wait_for_layer_load(name)
    c.wait_for_save()
    errors = c.get_block_ids_with_load_errors()
    c.clear_connector_metadata()
    return errors
