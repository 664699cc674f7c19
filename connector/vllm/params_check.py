"""A 400 from vLLM's OpenAI server for malformed tierkv request controls.

vLLM 0.32 gives a KV connector no hook at request entry: the connector first sees a request in the engine's
scheduler, where it can no longer refuse it. vLLM does run, in the API server process and before a request
reaches the engine, the ``validate_params`` class method of every custom logits processor; a ``ValueError`` there
becomes an HTTP 400 whose message is the error's. :class:`TierKVParamsCheck` is such a processor that only validates
(``kv_transfer_params["tierkv"]``, :mod:`tierkv.connector.core.request_params`) and leaves the logits alone. Start the
server with::

    vllm serve ... --logits-processors tierkv.connector.vllm.params_check:TierKVParamsCheck

Without it a malformed control is refused in the scheduler instead: the request is served without tierkv and its
response's ``kv_transfer_params`` is ``{"tierkv_error": "..."}`` (:meth:`TierKVConnector._controls`).
"""
from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor

from tierkv.connector.core.request_params import RequestParamsError, parse_controls


class TierKVParamsCheck(LogitsProcessor):
    """Validates tierkv's request controls at request entry; a no-op on the logits."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        """Raises ValueError (vLLM answers 400) naming the bad field of ``kv_transfer_params.tierkv``."""
        extra = getattr(sampling_params, "extra_args", None) or {}
        try:
            parse_controls(extra.get("kv_transfer_params"))
        except RequestParamsError as e:
            raise ValueError(str(e)) from None

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        return None
