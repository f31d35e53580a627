"""The policy items' names are written once, as Literal types (agent/names/policy_items.py); the tuples
are read from them, and a union of Literal types drops a name given twice without a word."""

from __future__ import annotations

from agent.names import policy_items as names


def test_a_name_is_a_gpu_item_or_a_node_item_never_both() -> None:
    # `policy.modes` keys, the registry and the `item` label take a name to mean one item: the union
    # would fold a name in both lists into one, and one of the two items would go unregistered.
    assert set(names.GPU_ITEM_NAMES).isdisjoint(names.NODE_ITEM_NAMES)
    assert (*names.GPU_ITEM_NAMES, *names.NODE_ITEM_NAMES) == names.ITEM_NAMES


def test_a_report_only_item_is_an_item_the_agent_never_writes() -> None:
    assert set(names.REPORT_ONLY_ITEM_NAMES) <= set(names.ITEM_NAMES)
    assert set(names.REPORT_ONLY_ITEM_NAMES).isdisjoint(names.SETTABLE_GPU_ITEM_NAMES)
    # the settable ones first, in the order `gpu-agent plan` lists them
    assert names.GPU_ITEM_NAMES[: len(names.SETTABLE_GPU_ITEM_NAMES)] == names.SETTABLE_GPU_ITEM_NAMES
