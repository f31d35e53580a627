"""The steps actions journal as they complete, named so recovery can read back what was left undone.

A step is "<verb> <name>": `draining sglang`, `drained sglang`, `stopping sglang`, `stopped sglang`,
`restarting sglang`, `started sglang`, `reset GPU 0`. Taking a service down is journaled before it is
asked (`draining`, `stopping`, `restarting`): an agent killed while the drain hook or the stop
command runs has still said so. A service with such a step and no later `started`/`restarted` one
may be down (or drained and not restarted): at start, recovery starts it again if it is not
running (agent.daemon.action_worker).
"""

from __future__ import annotations

from collections.abc import Sequence

DRAINING = "draining"
DRAINED = "drained"
STOPPING = "stopping"
STOPPED = "stopped"
RESTARTING = "restarting"
STARTED = "started"
RESTARTED = "restarted"
GPU_RESET = "reset GPU"
POLICY_APPLIED = "policy re-applied"

_DOWN = (DRAINING, DRAINED, STOPPING, STOPPED, RESTARTING)
_UP = (STARTED, RESTARTED)


def step(verb: str, name: str) -> str:
    return f"{verb} {name}"


def services_left_down(steps: Sequence[str]) -> list[str]:
    """The services the journaled steps took down and did not bring back, in the order they went down."""
    down: list[str] = []
    for entry in steps:
        verb, _, name = entry.partition(" ")
        if verb in _DOWN and name not in down:
            down.append(name)
        elif verb in _UP and name in down:
            down.remove(name)
    return down
