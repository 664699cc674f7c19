"""docs/architecture.md's generated parts (vLLM hooks, L3 backends, layout) match the code
(``tierkv/docs_gen.py``)."""
import pytest

from tierkv import docs_gen
from tierkv.docs_gen import REGENERATE, begin, end

DOC = docs_gen.doc_path()


def test_architecture_generated_parts_are_current():
    stale = docs_gen.stale_parts(DOC.read_text(encoding="utf-8"))
    assert not stale, (f"docs/architecture.md is out of date with the code in its generated parts {stale}: "
                       f"run `{REGENERATE}`")


def test_every_module_and_hook_has_a_docstring():
    """The generated parts show docstring summaries, so a module or hook without one leaves a hole in the doc."""
    assert [m for m, doc in docs_gen.modules() if not doc] == []
    hooks = docs_gen.hooks()
    assert [name for _side, name, doc in hooks if not doc] == []
    names = {name for _side, name, _doc in hooks}
    assert {"get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
            "start_load_kv", "wait_for_save", "get_finished"} <= names


def test_backend_list_is_the_factory_name_list():
    from tierkv.storage_backends import factory

    assert [b[0] for b in docs_gen.l3_backends()] == [n for n in factory.L3_BACKENDS if n != "none"]
    assert all(doc for *_rest, doc in docs_gen.l3_backends())


def test_a_changed_part_is_found_and_rewritten(tmp_path):
    text = DOC.read_text(encoding="utf-8")
    good = docs_gen.render(text)
    assert docs_gen.stale_parts(good) == []
    broken = good.replace("| `connector/core/plan.py` |", "| `connector/plan_gone.py` |", 1)
    assert broken != good
    assert docs_gen.stale_parts(broken) == ["layout"]
    assert docs_gen.render(broken) == good
    path = tmp_path / "architecture.md"
    path.write_text(broken, encoding="utf-8")
    assert docs_gen.main(["--doc", str(path), "--check"]) == 1
    assert docs_gen.main(["--doc", str(path), "--write"]) == 0
    assert path.read_text(encoding="utf-8") == good
    assert docs_gen.main(["--doc", str(path), "--check"]) == 0


def test_missing_markers_are_an_error():
    text = docs_gen.render(DOC.read_text(encoding="utf-8"))
    without = text.replace(end("layout"), "")
    assert "layout" in docs_gen.stale_parts(without)
    with pytest.raises(RuntimeError, match="no markers"):
        docs_gen.render(without.replace(begin("layout"), ""))


BASE = '''
class KVConnectorBase_V1(ABC):
    def __init__(self, vllm_config, role): ...

    @property
    def requires_kv_delivery(self) -> bool: ...

    # ==============================
    # Worker-side methods
    # ==============================

    def wait_for_save(self): ...

    # ==============================
    # Scheduler-side methods
    # ==============================

    def request_finished(self, request, block_ids): ...

    @classmethod
    def build_kv_connector_stats(cls, data=None): ...
'''

CONNECTOR = '''
class Mine(KVConnectorBase_V1):
    def build_kv_connector_stats(cls, data=None):
        """Stats."""

    def wait_for_save(self):
        """Saves.

        More text."""

    def request_finished(self, request, block_ids):
        """Release
        the lock."""

    def _helper(self): ...

    def requires_kv_delivery(self):
        return False
'''


def test_hook_sides_follow_vllms_sections():
    assert docs_gen.vllm_sides(BASE) == {"requires_kv_delivery": "both", "wait_for_save": "worker",
                                         "request_finished": "scheduler", "build_kv_connector_stats": "class"}
    assert docs_gen.hooks(BASE, CONNECTOR) == [("scheduler", "request_finished", "Release the lock."),
                                              ("worker", "wait_for_save", "Saves."),
                                              ("both", "requires_kv_delivery", None),
                                              ("class", "build_kv_connector_stats", "Stats.")]
    with pytest.raises(RuntimeError, match="Worker-side methods"):
        docs_gen.vllm_sides(BASE.replace("# Worker-side methods", "# Worker methods"))


def test_citations_of_numbered_sections_are_left_out():
    assert docs_gen.plain("Keeps stepping (docs/architecture.md §4). Saves (none failed, docs §8 R31); "
                          "L3 (``x``, docs/architecture.md §4)") == "Keeps stepping. Saves (none failed); L3 (`x`)"
