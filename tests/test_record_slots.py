"""The span record holds the span's facts; the module hooks' own bookkeeping lives with the hooks (issue 28).

A ``Record`` slot that nothing reads but ``capture/tracker.py`` is the tracker's (a call's inputs, its
inputs' autograd edges, its hooked outputs: the tracker's per-call lists). Read from the source: every slot
is read outside capture/ (but in ``Record``'s own ``__init__``/``reset`` and the record pool's unlinking),
save the two hooks a record keeps so that it is reused with them (no hook object made per call).
"""

from __future__ import annotations

import ast
import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "commdebug_otel"
# Kept on the record, with the reason: the record is its own backward-begin tensor hook and calls the
# tracker's callback through backward_hook; its backward-end hook object is reused with it (end_hook).
# Elsewhere each would be one object more per call alive through the step, which a step's garbage
# collections promote (tests/test_bounds.py::test_a_traced_step_keeps_few_objects_alive_per_module_call).
HOOKS_KEPT = {"backward_hook", "end_hook"}


def _record_slots() -> tuple[str, ...]:
    tree = ast.parse((PACKAGE / "core" / "records.py").read_text(encoding="utf-8"))
    record = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Record")
    return next(ast.literal_eval(item.value) for item in record.body
                if isinstance(item, ast.Assign) and getattr(item.targets[0], "id", "") == "__slots__")


def _readers_source() -> str:
    """The package's source but capture/, the record pool, and ``Record``'s ``__init__`` and ``reset``."""
    texts = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("capture/") or relative == "core/record_pool.py":
            continue
        text = path.read_text(encoding="utf-8")
        if relative == "core/records.py":
            text = re.sub(r"    def (__init__|reset)\(self.*?(?=\n    def )", "", text, flags=re.S)
        texts.append(text)
    return "\n".join(texts)


def test_every_record_slot_is_a_span_fact_or_a_hook_kept_with_the_record():
    slots = _record_slots()
    assert "attrs" in slots and "call_index" in slots  # the parse found the slots
    source = _readers_source()
    trackers_own = [slot for slot in slots if slot not in HOOKS_KEPT and not re.search(rf"\.{slot}\b", source)]
    assert trackers_own == []
