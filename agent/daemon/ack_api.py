"""`gpu-agent ack` through the running daemon: the status API's `ack` method. The acknowledgement is
made in the store the daemon runs on, whatever agent.yaml names now (a reload refused because it
changes state_dir leaves the file naming another directory), and the Xids it marks dealt with leave
the daemon's health window at once. Like a tune sweep it changes what the daemon will do: only root
or the agent's own user may call it (agent/api_server.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from agent.api import ApiError
from agent.store.db import StoreError
from agent.store.selector import parse_ack_selector

if TYPE_CHECKING:
    from agent.daemon.live import Live

ACK_METHODS = frozenset({"ack"})
#: A selector is a rule name, a UUID or a few words: a longer one is not one.
MAX_SELECTOR_CHARS = 512


def ack_handlers(live: Live) -> dict[str, Callable[[Any], Any]]:
    """The `ack` method: {"selector": TEXT} -> AckResult as JSON, made in the daemon's store under its
    node memory's boot; the (GPU, Xid) marks it cleared leave the Xid watcher's health window."""

    def ack(params: Any) -> Any:
        selector = params.get("selector") if isinstance(params, dict) else None
        if not isinstance(selector, str) or not 0 < len(selector) <= MAX_SELECTOR_CHARS:
            raise ApiError(f"ack needs a selector (a string of 1-{MAX_SELECTOR_CHARS} characters)")
        try:
            parsed = parse_ack_selector(selector)
        except ValueError as exc:
            raise ApiError(str(exc)) from None
        current = live.store
        if current is None:
            raise ApiError("the daemon's event store is not open (`gpu-agent status` says why): nothing acknowledged")
        try:
            result = current.acknowledge(parsed, live.memory_boot_id)
        except StoreError as exc:
            raise ApiError(f"the daemon's event store: {exc}") from None
        live.watchers.xid.forget(set(result.cleared))
        return asdict(result)

    return {"ack": ack}
