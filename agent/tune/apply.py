"""`gpu-agent tune apply` and `gpu-agent tune undo`: the last recommendation put in force as a policy
drop-in beside agent.yaml (`agent.d/90-tune.yaml`, agent.policy.dropins), and taken away, each in one
step. The CLI writes the file (the daemon's sandbox keeps /etc/gpu-agent read-only: configuration
comes from people) and the daemon reloads it.

apply:

1. asks the running daemon for the last sweep and the GPUs that answer now;
2. refuses, with the reason, when there is nothing to apply (no sweep, or one that recommends
   nothing) or the recommendation is stale: a swept GPU gone or another in its place, a model
   whose GPUs were all swept that has more or fewer now, or a profile in force for a swept GPU
   (apart from the tune drop-in itself) that changed since the sweep measured against it;
3. writes the drop-in's text: for each model whose GPUs were all swept an override matching the
   model, else one per swept GPU matching its uuid, each setting only the recommended key;
4. checks agent.yaml with every drop-in and this one in place, as check-config does (a file the
   config rejects is refused before anything is written), and warns about shadowed profiles;
5. writes it atomically (a temporary file beside it, fsynced, renamed over it): a kill at any moment
   leaves the earlier file or the new one whole, never half of one; a kill after the write and before
   the reload leaves a checked file the daemon has not read yet, which `tune apply` again (or
   `systemctl reload gpu-agent`) puts in force and `tune undo` takes away;
6. asks the daemon to reload and waits for its answer; a reload it refuses (all or nothing, as
   SIGHUP) puts the earlier drop-in back, or removes the new one, so the file and what runs agree;
7. says so when the item is in observe mode: the drop-in is written and read, and the daemon reports
   the new value as drift without setting it.

undo removes the drop-in and reloads, the same way (a refused reload puts the file back).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agent.api import ApiError
from agent.backend.base import GpuIdentity
from agent.config import AgentConfig, ConfigError, Mode
from agent.policy.dropins import TUNE_DROPIN, dropin_directory, without_dropin
from agent.policy.profiles import resolve_profile, shadowed
from agent.tune.defaults import KNOB_UNITS, POLICY_ITEMS
from agent.tune.model import TuneDocument
from agent.tune.recommend import knob_settings, yaml_lines

#: How long the CLI waits for the daemon's reload (a loop in progress finishes first).
RELOAD_ANSWER_SECONDS = 75.0
#: The knob each kind sets in a profile.
KNOB_KEYS: dict[str, str] = {"power": "power_limit_watts", "clocks": "locked_clocks"}


class ApplyRefused(Exception):
    """Nothing was written: the reason, for the operator."""


# -- pure: is the recommendation still true, and what the drop-in says ------------------------------


def stale(document: TuneDocument, now: Mapping[int, tuple[str, str]], config: AgentConfig) -> list[str]:
    """Why the sweep's recommendation no longer fits the node, one line each (none: it does).
    `now`: index -> (uuid, model) of every GPU that answers; `config`: agent.yaml and its drop-ins as on disk."""
    found: list[str] = []
    policy = without_dropin(config.policy)
    key = KNOB_KEYS[document.request.kind]
    for gpu in document.swept:
        uuid, model = now.get(gpu.gpu, ("", ""))
        if uuid.lower() != gpu.uuid.lower():
            found.append(f"GPU {gpu.gpu} is {uuid or 'gone'} now, not the {gpu.uuid} the sweep measured")
            continue
        if gpu.whole_model:
            count = sum(1 for _uuid, name in now.values() if name == model)
            swept = sum(1 for other in document.swept if other.model == model)
            if count != swept:
                found.append(f"the node has {count} {model} GPUs now, {swept} when the sweep measured all of them")
        profile = resolve_profile(policy, GpuIdentity(gpu.gpu, uuid, model, "", "", "", 0))
        settings = profile.profile.model_dump(mode="json", exclude_none=True, exclude={"match"}) if profile else {}
        if settings.get(key) != gpu.settings.get(key):
            then, now_set = _shown(gpu.settings.get(key)), _shown(settings.get(key))
            found.append(
                f"GPU {gpu.gpu}'s {key} in the config is {now_set} now, {then} when the sweep measured against it"
            )
    return found


def _shown(value: Any) -> str:
    return "unset" if value is None else json.dumps(value)


def dropin_text(document: TuneDocument, when: str) -> str:
    """The drop-in that puts the recommendation in force for exactly the swept GPUs (see step 3)."""
    recommendation = document.recommendation
    assert recommendation is not None  # checked by the caller: nothing to apply otherwise
    request = document.request
    unit = KNOB_UNITS[request.kind]
    lines = [
        f"# Written by `gpu-agent tune apply` on {when}: {recommendation.setting:g} {unit} from tune {document.id}",
        f"# ({request.kind} sweep of service {request.service}). `gpu-agent tune undo` removes it; agent.yaml",
        "# is left as it was. Read after agent.yaml: each override changes only the key it sets.",
        "policy:",
        "  gpu_overrides:",
    ]
    whole = {g.model for g in document.swept if g.whole_model}
    for model in sorted(whole):
        first = next(g for g in document.swept if g.model == model)
        knob = knob_settings(request.kind, recommendation.setting, first.settings)
        lines += yaml_lines(f"{{model: {json.dumps(model)}}}", knob, "every GPU of this model was swept")
    for gpu in document.swept:
        if gpu.model not in whole:
            knob = knob_settings(request.kind, recommendation.setting, gpu.settings)
            lines += yaml_lines(f"{{uuid: {json.dumps(gpu.uuid)}}}", knob, f"GPU {gpu.gpu}")
    return "\n".join(lines) + "\n"


# -- the commands ----------------------------------------------------------------------------------


def _call(socket: str, method: str, params: dict[str, Any] | None = None, timeout: float = 10.0) -> Any:
    from agent import api

    return api.call(socket, method, params or {}, timeout_seconds=timeout)


def _checked(config_path: Path, text: str | None) -> AgentConfig:
    """agent.yaml with every drop-in and the tune drop-in as `text` (None: without it), as the daemon
    would load it; ApplyRefused naming what the config rejects."""
    from agent.policy.dropins import load_checked_config

    try:
        return load_checked_config(config_path, {TUNE_DROPIN: text})
    except ConfigError as exc:
        problems = "; ".join(str(p) for p in exc.problems)
        raise ApplyRefused(f"the config would be rejected, so nothing was written: {problems}") from None


def _write(path: Path, text: str | None) -> None:
    """The drop-in as `text`, atomically (None: removed)."""
    from agent.host import safe_fs

    absolute = os.path.abspath(path)
    if text is None:
        safe_fs.remove_file("/", absolute)
    else:
        safe_fs.write_file_atomic("/", absolute, text.encode(), mode=0o644)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _reload(socket: str, config_path: Path, path: Path, earlier: str | None) -> str:
    """Ask the daemon to reload: "" once it has; a note when no daemon runs (it reads the file when it
    starts). A refusal, or no answer in time, puts `earlier` back and raises ApplyRefused."""
    try:
        answer = _call(socket, "reload", {"config_path": os.path.abspath(config_path)}, RELOAD_ANSWER_SECONDS)
    except (FileNotFoundError, ConnectionRefusedError):
        return f"no daemon answers on {socket}: it reads {path} when it starts"
    except (ApiError, OSError) as exc:
        _write(path, earlier)
        raise ApplyRefused(f"the daemon did not reload ({exc}); {path} is as it was (run the command again)") from None
    if not answer.get("reloaded"):
        _write(path, earlier)
        why = answer.get("error") or "config change needs a restart: " + ", ".join(answer.get("pending_restart", []))
        raise ApplyRefused(f"the daemon refused the reload ({why}); {path} is as it was, and so is the running config")
    return ""


def apply_last(socket: str, config_path: Path) -> list[str]:
    """Put the last recommendation in force (see the module docstring); what was done, line by line.
    ApplyRefused when nothing was (or nothing stays) written."""
    last = _call(socket, "tune_status")
    if last is None:
        raise ApplyRefused("no sweep has run on this node: nothing to apply (gpu-agent tune power ... measures one)")
    document = TuneDocument.from_json(last)
    if document.state == "running":
        raise ApplyRefused(f"tune {document.id} is still running: apply its recommendation once it ends")
    if document.recommendation is None or not document.swept:
        why = document.detail or document.state
        raise ApplyRefused(f"the last sweep (tune {document.id}, {document.state}) recommends nothing: {why}")
    status = _call(socket, "status")
    now = {int(g["index"]): (str(g["uuid"]), str(g["name"])) for g in status.get("gpus", []) if g.get("up")}
    config = _checked(config_path, None)
    reasons = stale(document, now, config)
    if reasons:
        raise ApplyRefused(f"tune {document.id}'s recommendation is stale: {'; '.join(reasons)}; run the sweep again")
    path = dropin_directory(config_path) / TUNE_DROPIN
    text = dropin_text(document, time.strftime("%Y-%m-%d %H:%M:%S"))
    new = _checked(config_path, text)
    earlier = _read(path)
    _write(path, text)
    note = _reload(socket, config_path, path, earlier)
    unit = KNOB_UNITS[document.request.kind]
    recommendation = document.recommendation
    done = [f"tune {document.id}: {recommendation.setting:g} {unit} in force for {recommendation.targets}"]
    done.append(f"  written to {path}; {note or 'reloaded'}; gpu-agent tune undo takes it back")
    item = POLICY_ITEMS[document.request.kind]
    if new.item_mode(item) is not Mode.ENFORCE:
        done.append(
            f"  note: {item} is in observe mode: the daemon reads the new value and reports it as drift, but"
            f" does not set it (mode: enforce, or policy.modes.{item}: enforce, lets it)"
        )
    done += [f"  warning: {line}" for line in shadowed(new.policy)]
    return done


def undo(socket: str, config_path: Path) -> list[str]:
    """Take the tune drop-in away and reload; what was done. ApplyRefused when the file stays."""
    path = dropin_directory(config_path) / TUNE_DROPIN
    earlier = _read(path)
    if earlier is None:
        return [f"nothing to undo: no {path} (the policy is agent.yaml's and its own drop-ins')"]
    _checked(config_path, None)
    _write(path, None)
    note = _reload(socket, config_path, path, earlier)
    return [f"removed {path}; {note or 'reloaded'}: the policy is agent.yaml's again (and its own drop-ins')"]


def cmd_apply_or_undo(socket: str, config_path: str | None, undoing: bool) -> int:
    """`gpu-agent tune apply` / `tune undo`: 0 done (or nothing to undo), 1 refused or failed."""
    if config_path is None:
        needs = "needs a config file (--config, or /etc/gpu-agent/agent.yaml): the drop-in goes beside it"
        print(f"gpu-agent tune: {needs}", file=sys.stderr)
        return 1
    try:
        lines = undo(socket, Path(config_path)) if undoing else apply_last(socket, Path(config_path))
    except ApplyRefused as exc:
        print(f"gpu-agent tune {'undo' if undoing else 'apply'}: refused: {exc}", file=sys.stderr)
        return 1
    except ApiError as exc:
        print(f"gpu-agent tune: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"gpu-agent tune: no daemon answers on {socket}, or the drop-in could not be written ({exc})",
              file=sys.stderr)  # fmt: skip
        return 1
    print("\n".join(lines))
    return 0
