"""The one place that acts: carries out the Decisions the rule engine made.

`dispatch.execute(decision, ctx)` runs one decision and says how it went (an `ActionOutcome`); it never
raises, so one broken action cannot take the daemon down. It blocks: restart_service and reset_gpu
wait until the services answer again (up to `ready_timeout_seconds`, 600 s by default, since a
large model loads for minutes), so the daemon calls it from a worker, not from its collection loop.

Each handler receives its action's parameters as the pydantic model the rules file was validated
against (agent/rules/params.py); nothing here checks a parameter again.

What runs when
--------------
- A suppressed decision (no action) is SUPPRESSED and a dry-run decision is DRY_RUN: nothing runs.
- In observe mode (`mode: observe`, the default) the actions that change the node, namely
  `restart_service`, `reset_gpu` and `reboot`, are REFUSED. The others still run: `webhook`,
  `alertmanager`, `recommend_reboot` (a flag file and an alert) and `run_hook` tell people and
  systems about a fault without touching the GPUs or the services, which is what observing is for.
  A hook runs whatever its owner wrote, so an operator who wants nothing run at all does not
  configure hooks.

Where each action lives
-----------------------
- dispatch.py: `execute`, the observe-mode refusal, one handler per kind.
- service_actions.py: restart_service (the step's service, else the decision's, else every service
  using the target GPU; restarted through its manager, then healthy within `ready_timeout_seconds`
  or FAILED).
- reset.py: reset_gpu, the safe sequence (services stopped, GPU idle, reset inside a hardware
  transaction that puts the power limit and clock lock back (agent/policy/holds.py), policy
  re-applied, services started and healthy; refused for Xid 79, a lost GPU, MIG, a re-enumerated
  index).
- hooks.py: run_hook (argv, never a shell; event JSON on stdin; trusted files only).
- notify.py: webhook and alertmanager; alertmanager.py: which catalogue alert a step raises in the
  push book (agent/alerts/book.py); http_client.py: POST with a total deadline, no redirects, no
  secrets in errors.
- reboot.py: recommend_reboot (flag file + alert) and reboot (`remediation.allow_reboot` only).
- footprint.py: the GPUs a decision touches, by its kind's lane (agent/rules/params.py
  `ACTION_LANES`): what the daemon's action worker keeps it apart from.
"""
