"""The action kinds, one module each, named for its kind (`reset_gpu.py` is `reset_gpu`).

A module declares its kind once, as `ACTION: Final = ActionType(...)` (agent/rules/actions/kind.py):
its parameter model (a subclass of `ActionParams` naming the kind), its handler, what it does, whether
it changes the node (observe mode then records it as a dry run instead of running it), its lane and
the GPUs it touches, what the engine aims it at, and how many one evaluation decides. Nothing else
lists the kinds: agent/rules/actions/registry.py finds every module here, and the rules file, the
engine, dispatch, observe mode, the worker's lanes, check-config and README's table read it.
"""
