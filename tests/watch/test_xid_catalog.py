"""The Xid catalog data (agent/watch/xid_catalog.json) and its loader."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from importlib import resources
from typing import Any

import pytest
from action_kinds import ActionKind

from agent.events import ACTION_ORDER, SuggestedAction, more_drastic
from agent.watch import xid_catalog
from agent.watch.xid_catalog import ACTIONS, CatalogError, XidInfo, parse_catalog

REQUIRED_CODES = [
    *[8, 13, 31, 32, 38, 43, 45, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 109],
    *[119, 120, 121, 122, 123, 124, 136, 137, 140, 143, *range(144, 151), 151, 154, 155, 156, 157, 158, 159],
]
# Resolution buckets exactly as NVIDIA's Xid catalog names them (plus UNKNOWN where it gives none).
NVIDIA_BUCKETS = {
    "CONTACT_SUPPORT",
    "RESTART_APP",
    "IGNORE",
    "WORKFLOW_XID_45",
    "RESET_GPU",
    "WORKFLOW_XID_48",
    "CHECK_MECHANICALS",
    "WORKFLOW_NVLINK_ERR",
    "UPDATE_SWFW",
    "RESTART_BM",
    "WORKFLOW_NVLINK5_ERR",
    "RESTART_VM",
    "XID_154",
    "CHECK_UVM",
}


def row(code: int) -> XidInfo:
    info = xid_catalog.lookup(code)
    assert info is not None, code
    return info


def shipped_data() -> dict[str, Any]:
    text = resources.files("agent.watch").joinpath("xid_catalog.json").read_text(encoding="utf-8")
    data = json.loads(text)
    assert isinstance(data, dict)
    return data


def test_every_required_code_has_an_nvidia_bucket() -> None:
    for code in REQUIRED_CODES:
        info = row(code)
        assert info.resolution in NVIDIA_BUCKETS, (code, info.resolution)
        assert info.name and info.description and info.mnemonic


def test_catalog_covers_nvidia_rows_1_to_172_in_order() -> None:
    assert xid_catalog.all_codes() == list(range(1, 173))
    assert {row(code).resolution for code in xid_catalog.all_codes()} <= NVIDIA_BUCKETS | {"UNKNOWN"}
    # The newest rows have no bucket yet in NVIDIA's sheet; the catalog must say so, not guess.
    unknown = [code for code in xid_catalog.all_codes() if row(code).resolution == "UNKNOWN"]
    assert unknown == list(range(162, 173))


@pytest.mark.parametrize(
    ("code", "resolution", "investigatory"),
    [
        (13, "RESTART_APP", "WORKFLOW_XID_13"),
        (31, "RESTART_APP", "WORKFLOW_XID_31"),
        (43, "IGNORE", "CONTACT_SUPPORT"),
        (45, "WORKFLOW_XID_45", "Solo: RESTART_FM Not Solo: IGNORE (follow other Xid)"),
        (48, "WORKFLOW_XID_48", "WORKFLOW_XID_48"),
        (54, "CHECK_MECHANICALS", "CONTACT_SUPPORT"),
        (63, "IGNORE", "IGNORE"),
        (64, "RESET_GPU", "CONTACT_SUPPORT"),
        (74, "WORKFLOW_NVLINK_ERR", "CONTACT_SUPPORT"),
        (79, "RESTART_BM", "CONTACT_SUPPORT"),
        (94, "RESTART_APP", "IGNORE (sympathetic)"),
        (95, "RESET_GPU", "IGNORE (sympathetic)"),
        (122, "CONTACT_SUPPORT", ""),
        (145, "WORKFLOW_NVLINK5_ERR", "WORKFLOW_NVLINK5_ERR"),
        (151, "RESTART_VM", "CONTACT_SUPPORT"),
        (154, "XID_154", "N/A Informational only regarding another Xid"),
        (159, "CHECK_UVM", "SYMPATHETIC_REPORT_SOLO"),
    ],
)
def test_buckets_match_nvidia(code: int, resolution: str, investigatory: str) -> None:
    assert (row(code).resolution, row(code).investigatory) == (resolution, investigatory)


def test_applicability_follows_nvidia_columns() -> None:
    def applies(code: int) -> tuple[str, ...]:
        return row(code).applies_to

    assert applies(79) == ("A100", "H100", "B100", "GB200")
    assert applies(74) == ("A100", "H100")  # NVLink4 and older; Blackwell reports 144-150
    assert applies(145) == ("B100", "GB200")
    assert applies(121) == ("GB200",)  # C2C link to Grace
    assert applies(136) == ("H100",)
    assert applies(122) == ()  # unused


def test_field_experience_defaults() -> None:
    def action(code: int) -> str:
        return row(code).action

    for code in (13, 31, 43, 45, 68, 69, 94):
        assert action(code) == "restart_service", code
    for code in (46, 48, 62, 64, 74, 95, 109, 119, 120, 136, 140, 143, 155, 156, 158):
        assert action(code) == "reset_gpu", code
    assert action(79) == "reboot"
    # Board-level faults a GPU reset cannot clear.
    assert action(110) == "reboot"
    assert action(167) == "reboot"
    # NVLink5: the line's own fatal flag and the following Xid 154 decide; never reset blindly.
    assert {action(code) for code in range(144, 151)} == {"alert"}
    assert action(154) == "alert"
    # Every RESET_GPU row resets, except the security fault NVIDIA says needs a cold system reset.
    reset_rows = [c for c in xid_catalog.all_codes() if row(c).resolution == "RESET_GPU"]
    assert {c for c in reset_rows if action(c) != "reset_gpu"} == {110}
    # Every RESTART_APP row restarts the service.
    app_rows = [c for c in xid_catalog.all_codes() if row(c).resolution == "RESTART_APP"]
    assert {action(c) for c in app_rows} == {"restart_service"}


def test_severity_ranks_the_fault() -> None:
    def severity(code: int) -> str:
        return row(code).severity

    assert severity(79) == "fatal"
    assert severity(48) == "critical"
    assert severity(13) == "warning"
    assert severity(63) == "info"
    assert [c for c in xid_catalog.all_codes() if severity(c) == "fatal"] == [79]


def test_one_vocabulary_of_remedies() -> None:
    """The catalog's actions, its Xid 154 mapping, the health ranking and the rule actions that carry
    a remedy out are all SuggestedAction: one set of words, one order."""
    cat = xid_catalog.catalog()
    assert all(isinstance(info.action, SuggestedAction) for info in cat.entries.values())
    assert all(isinstance(action, SuggestedAction) for action in cat.recovery_actions.values())
    assert tuple(SuggestedAction) == ACTION_ORDER
    assert [a.rank for a in ACTION_ORDER] == list(range(len(ACTION_ORDER)))
    assert more_drastic(SuggestedAction.RESET_GPU, SuggestedAction.REBOOT) is SuggestedAction.REBOOT
    assert more_drastic(SuggestedAction.CHECK_MECHANICALS, SuggestedAction.RESTART_SERVICE) is (
        SuggestedAction.CHECK_MECHANICALS
    )
    remedies = {kind: SuggestedAction(kind.value) for kind in ActionKind if kind.value in ACTIONS}
    assert set(remedies) == {ActionKind.RESTART_SERVICE, ActionKind.RESET_GPU, ActionKind.REBOOT}


def test_verdict_covers_unknown_codes() -> None:
    known = xid_catalog.verdict(48)
    assert (known.severity, known.action, known.resolution, known.known) == (
        "critical",
        SuggestedAction.RESET_GPU,
        "WORKFLOW_XID_48",
        True,
    )
    unknown = xid_catalog.verdict(998)
    assert (unknown.name, unknown.severity, unknown.action, unknown.resolution, unknown.known) == (
        "Unknown Xid",
        "warning",
        SuggestedAction.ALERT,
        "UNKNOWN",
        False,
    )


def test_lookup_unknown_code_is_none() -> None:
    assert xid_catalog.lookup(0) is None
    assert xid_catalog.lookup(500) is None
    assert xid_catalog.lookup(-1) is None


def test_xid_info_is_immutable() -> None:
    info = xid_catalog.lookup(79)
    assert isinstance(info, XidInfo)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.action = "none"  # type: ignore[misc]


def test_explain_79() -> None:
    data = xid_catalog.explain(79)
    assert data["code"] == 79
    assert data["known"] is True
    assert data["name"] == "GPU has fallen off the bus"
    assert data["mnemonic"] == "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS"
    assert data["resolution"] == "RESTART_BM"
    assert data["resolution_text"] == "Restart the bare-metal system."
    assert data["investigatory"] == "CONTACT_SUPPORT"
    assert data["severity"] == "fatal"
    assert data["action"] == "reboot"
    assert data["applies_to"] == ["A100", "H100", "B100", "GB200"]
    assert "PCI Express" in str(data["description"])
    assert data["source"] == "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"
    # It is what `gpu-agent xid explain 79 --json` prints.
    assert json.loads(json.dumps(data)) == data


@pytest.mark.parametrize("code", [0, -3, 173, 500, 10**6])
def test_explain_unknown_code_does_not_raise(code: int) -> None:
    data = xid_catalog.explain(code)
    assert data["known"] is False
    assert data["code"] == code
    assert data["resolution"] == "UNKNOWN"
    assert (data["severity"], data["action"]) == ("warning", "alert")
    assert f"Xid {code} is not in NVIDIA's Xid catalog" in str(data["description"])
    json.dumps(data)
    text = xid_catalog.explain_text(code)
    assert text.startswith(f"Xid {code}: unknown\n")
    assert "severity warning, action alert" in text


def test_explain_text_79() -> None:
    lines = xid_catalog.explain_text(79).splitlines()
    assert lines[0] == "Xid 79: GPU has fallen off the bus (ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS)"
    assert "NVIDIA resolution: RESTART_BM: Restart the bare-metal system." in lines
    assert "NVIDIA investigatory action: CONTACT_SUPPORT" in lines
    assert "Applies to: A100, H100, B100, GB200" in lines
    assert lines[-1] == "gpu-agent default: severity fatal, action reboot"
    assert 4 <= len(lines) <= 8


def test_explain_text_shows_our_departures_from_nvidia() -> None:
    text = xid_catalog.explain_text(43)
    assert "NVIDIA resolution: IGNORE: No action required." in text
    assert "gpu-agent default: severity warning, action restart_service" in text
    assert text.splitlines()[-1].startswith("Note: ")
    assert "Applies to: none of A100, H100, B100, GB200" in xid_catalog.explain_text(1)


@pytest.mark.parametrize(
    ("label", "action"),
    [
        ("None", "none"),
        ("Drain P2P", "alert"),
        ("Drain and Reset", "reset_gpu"),
        ("GPU Reset Required", "reset_gpu"),
        ("Node Reboot Required", "reboot"),
        (" Node Reboot Required ", "reboot"),
        ("Reboot Everything", None),
    ],
)
def test_action_for_xid154_recovery_action(label: str, action: str | None) -> None:
    assert xid_catalog.action_for_recovery(label) == action


def test_shipped_file_is_pretty_sorted_and_sourced() -> None:
    text = resources.files("agent.watch").joinpath("xid_catalog.json").read_text(encoding="utf-8")
    data = json.loads(text)
    assert text == json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    codes = [row["code"] for row in data["xids"]]
    assert codes == sorted(codes)
    assert data["source"]["url"] == "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"
    assert data["source"]["transcribed"] == "2026-11-29"


def test_loaded_once() -> None:
    assert xid_catalog.catalog() is xid_catalog.catalog()
    assert parse_catalog(shipped_data()) == xid_catalog.catalog()


def _row(data: dict[str, Any], code: int) -> dict[str, Any]:
    return next(entry for entry in data["xids"] if entry["code"] == code)


def _set(code: int, key: str, value: object) -> Callable[[dict[str, Any]], None]:
    def mutate(data: dict[str, Any]) -> None:
        _row(data, code)[key] = value

    return mutate


def _drop(code: int, key: str) -> Callable[[dict[str, Any]], None]:
    def mutate(data: dict[str, Any]) -> None:
        del _row(data, code)[key]

    return mutate


def _swap_first_rows(data: dict[str, Any]) -> None:
    data["xids"][0], data["xids"][1] = data["xids"][1], data["xids"][0]


def _duplicate_row(data: dict[str, Any]) -> None:
    data["xids"].insert(1, copy.deepcopy(data["xids"][0]))


MALFORMED: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("bad severity", _set(79, "severity", "disaster"), r"Xid 79\).*severity 'disaster'"),
    ("bad action", _set(79, "action", "reinstall"), r"Xid 79\).*action 'reinstall'"),
    ("bucket not described", _set(48, "resolution", "REPLACE_GPU"), r"Xid 48\).*resolution 'REPLACE_GPU'"),
    ("empty bucket", _set(48, "resolution", ""), r"Xid 48\).*resolution must not be empty"),
    ("code as string", _set(13, "code", "13"), r"code must be an integer"),
    ("code as bool", _set(1, "code", True), r"code must be an integer"),
    ("code out of range", _set(172, "code", 5000), r"code 5000 out of range"),
    ("missing key", _drop(31, "action"), r"missing keys \['action'\]"),
    ("extra key", _set(31, "colour", "red"), r"unexpected keys \['colour'\]"),
    ("empty name", _set(31, "name", " "), r"Xid 31\).*name must not be empty"),
    ("bad model", _set(31, "applies_to", ["H200"]), r"applies_to must be a list"),
    ("description not text", _set(31, "description", 31), r"description must be a string"),
    ("out of order", _swap_first_rows, r"out of order"),
    ("duplicate", _duplicate_row, r"duplicated"),
    ("no rows", lambda data: data.update(xids=[]), r"xids: must be a non-empty list"),
    ("extra top key", lambda data: data.update(version=2), r"top-level keys"),
    ("source without url", lambda data: data["source"].pop("url"), r"source: must name url"),
    ("bad recovery action", lambda data: data["recovery_actions"].update(Maybe="pray"), r"unknown action 'pray'"),
    ("bucket text empty", lambda data: data["buckets"].update(RESET_GPU=""), r"buckets: entry 'RESET_GPU'"),
    ("bucket name", lambda data: data["buckets"].update({"reset gpu": "x"}), r"bad bucket name"),
]


@pytest.mark.parametrize(("mutate", "message"), [(m, msg) for _, m, msg in MALFORMED], ids=[n for n, _, _ in MALFORMED])
def test_malformed_catalog_fails_loudly(mutate: Callable[[dict[str, Any]], None], message: str) -> None:
    data = shipped_data()
    mutate(data)
    with pytest.raises(CatalogError, match=message):
        parse_catalog(data)


@pytest.mark.parametrize("data", [[], "catalog", None, {"xids": []}])
def test_malformed_top_level(data: object) -> None:
    with pytest.raises(CatalogError):
        parse_catalog(data)
