"""Speculative decoding on the scheduler side of the real connector: a step's draft tokens (vLLM's
``scheduled_spec_decode_tokens``) are scheduled and their KV written, but verified only after the step; a page is saved
only once every token in it is verified, under the key of the final tokens, so a repeated prompt loads every page stored
(vLLM #52735: pages stored under speculative decoding that no lookup ever matched).

The engine side is a stub in vLLM's shapes: ``all_token_ids`` is a live list holding verified tokens only (vLLM keeps
drafts in ``spec_token_ids``), and after a step with drafts the request's ``num_computed_tokens`` drops by the
rejected ones, as vLLM's ``update_from_output`` does.
"""
import logging
from types import SimpleNamespace

import pytest

from tierkv.connector.core.page_hash import RequestKeys
from tests.helpers.vllm_parts import BLOCK as P
from tests.helpers.vllm_parts import SCHEDULER, TierkvLoggerState, connector, write_model


@pytest.fixture
def model(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TIERKV_LEDGER_DIR", str(tmp_path))
    state = TierkvLoggerState()
    logging.getLogger("tierkv").propagate = False
    yield write_model(tmp_path / "model")
    state.restore()


def _request(rid, tokens):
    return SimpleNamespace(request_id=rid, all_token_ids=tokens, lora_request=None, cache_salt=None,
                           skip_reading_prefix_cache=False, num_prompt_tokens=len(tokens))


BLOCKS = [5, 6, 7, 8]


def _step(c, rid, computed, scheduled, drafts=(), new=False):
    """One scheduler step of ``rid``: ``computed`` tokens done before it, ``scheduled`` in it, ``drafts`` of those
    the step's draft tokens. Returns the plan's save orders."""
    state = SimpleNamespace(get_block_ids=lambda r: (BLOCKS,))
    new_reqs = [SimpleNamespace(req_id=rid, num_computed_tokens=computed, block_ids=(BLOCKS,))] if new else []
    cached = SimpleNamespace(req_ids=[] if new else [rid], num_computed_tokens=[] if new else [computed])
    so = SimpleNamespace(preempted_req_ids=(), num_scheduled_tokens={rid: scheduled}, scheduled_new_reqs=new_reqs,
                         scheduled_cached_reqs=cached, kv_connector_block_state=state,
                         scheduled_spec_decode_tokens={rid: list(drafts)} if drafts else {})
    return c.build_connector_meta(so).saves


def test_a_page_is_saved_only_once_its_tokens_are_verified_and_a_repeated_prompt_loads_every_stored_page(model):
    c = connector(model, SCHEDULER, {"host_pool.num_pages": 8})
    tokens = list(range(100, 162))                              # 62 prompt tokens
    c.on_new_request(_request("a", tokens))
    assert c.get_num_new_matched_tokens(_request("a", tokens), 0) == (0, False)
    [order] = _step(c, "a", 0, 62, new=True)                   # prefill: page 0
    assert order.block_ids == [5]
    tokens.append(7)                                            # the sampled token (position 62)
    # decode with 4 drafts at positions 63..66: page 1 (32..63) would be full of scheduled tokens, but position 63
    # holds a draft, verified only after the step
    assert _step(c, "a", 62, 5, drafts=[8, 9, 10, 11]) == []
    tokens += [8, 21]                                           # draft 8 accepted, 9 rejected: 21 sampled instead
    # 62 + 5 - 3 rejected = 64 computed; next step: 21 at 64 and 4 drafts; page 1 is verified now
    [order] = _step(c, "a", 64, 5, drafts=[22, 23, 24, 25])
    assert order.block_ids == [6]
    assert order.keys == [RequestKeys(c._sched.requests["a"].keys.root, P).extend(tokens)[1]]
    assert c._sched.counters.save_pages == 2
    c.request_finished(_request("a", tokens), BLOCKS)

    again = tokens[:64] + [1, 2, 3]                             # the prompt repeated with its verified output
    c.on_new_request(_request("b", again))
    assert c.get_num_new_matched_tokens(_request("b", again), 0) == (2 * P, False)   # both stored pages hit


def test_the_connector_counts_draft_tokens_out_of_the_tokens_a_step_makes_full(model, monkeypatch):
    c = connector(model, SCHEDULER, {"host_pool.num_pages": 8})
    tokens = list(range(100, 163))
    c.on_new_request(_request("a", tokens))
    seen = []
    monkeypatch.setattr(c._sched, "schedule_saves", lambda rid, n, blocks: seen.append((rid, n)))
    _step(c, "a", 62, 5, drafts=[8, 9, 10, 11])
    _step(c, "a", 63, 1)                                       # a step without drafts: every scheduled token counts
    assert seen == [("a", 63), ("a", 64)]
