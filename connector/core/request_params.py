"""Per-request controls of tierkv, carried in vLLM's ``kv_transfer_params`` under the key ``"tierkv"``.

An OpenAI request to vLLM's server can carry ``"kv_transfer_params": {"tierkv": {...}}``; vLLM hands it to the
connector as ``request.kv_transfer_params``. Fields, all optional (other keys belong to other connectors):

- ``load`` (bool): false = tierkv loads nothing for it (vLLM's own prefix cache, L1, still serves it);
- ``save`` (bool): false = none of its pages are saved into L2 (hence none reach L3);
- ``load_max_tokens`` (int >= 0): load at most the pages that end within the first N tokens;
- ``save_max_tokens`` (int >= 0): save only the pages that end within the first N tokens (the reusable prefix: a
  system prompt or a document, not the private suffix);
- ``keep`` (bool): true = the pages it saves bypass L3 admission (``l3.admission``): a document kept for a restart.

A wrong type, a negative count or an unknown field raises :class:`RequestParamsError` naming the field.
Engine-free: pydantic only.
"""
from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, NonNegativeInt, ValidationError

#: the key of ``kv_transfer_params`` that holds tierkv's controls
PARAMS_KEY = "tierkv"


class RequestParamsError(ValueError):
    """``kv_transfer_params["tierkv"]`` is malformed; the message names the field(s)."""


class RequestControls(BaseModel):
    """The controls of one request (see the module docstring); the defaults change nothing."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    load: bool = True
    save: bool = True
    load_max_tokens: Optional[NonNegativeInt] = None
    save_max_tokens: Optional[NonNegativeInt] = None
    keep: bool = False

    def load_pages(self, page_size: int) -> Optional[int]:
        """Most pages tierkv may load for the request (None = no limit)."""
        if not self.load:
            return 0
        return None if self.load_max_tokens is None else self.load_max_tokens // page_size

    def save_pages(self, page_size: int) -> Optional[int]:
        """Most leading pages of the request tierkv may save (None = no limit)."""
        if not self.save:
            return 0
        return None if self.save_max_tokens is None else self.save_max_tokens // page_size


def parse_controls(kv_transfer_params: Any) -> Optional[RequestControls]:
    """The tierkv controls of a request's ``kv_transfer_params``; None when it has none (no ``"tierkv"`` key).

    Raises:
        RequestParamsError: ``"tierkv"`` is not an object, or a field has a wrong type or value or is unknown; the
            message names each bad field as ``kv_transfer_params.tierkv.<field>``.
    """
    if not isinstance(kv_transfer_params, dict) or PARAMS_KEY not in kv_transfer_params:
        return None
    raw = kv_transfer_params[PARAMS_KEY]
    where = f"kv_transfer_params.{PARAMS_KEY}"
    if not isinstance(raw, dict):
        raise RequestParamsError(f"{where}: must be an object with the fields {', '.join(RequestControls.model_fields)}"
                                 f", got {type(raw).__name__}")
    try:
        return RequestControls.model_validate(raw)
    except ValidationError as e:
        parts = []
        for err in e.errors():
            field = ".".join(str(x) for x in err.get("loc", ())) or "?"
            msg = err.get("msg", "invalid")
            if err.get("type") == "extra_forbidden":
                msg = f"unknown field (allowed: {', '.join(RequestControls.model_fields)})"
            parts.append(f"{where}.{field}: {msg}")
        raise RequestParamsError("; ".join(parts)) from None
