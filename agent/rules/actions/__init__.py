"""The one place that acts: carries out the Decisions the rule engine made.

`dispatch.execute(decision, ctx)` runs one decision and says how it went (an `ActionOutcome`); it never
raises, so one broken action cannot take the daemon down. It blocks: restart_service and reset_gpu
wait until the services answer again (up to `ready_timeout_seconds`, 600 s by default, since a
large model loads for minutes), so the daemon calls it from a worker, not from its collection loop.

Each handler receives its action's parameters as the pydantic model the rules file was validated
against (its kind's `params`); nothing here checks a parameter again.

What runs when
--------------
- A suppressed decision (no action) is SUPPRESSED and a dry-run decision is DRY_RUN: nothing runs.
- In observe mode (`mode: observe`, the default) an action whose kind changes the node
  (`changes_node`: restart_service, reset_gpu, reboot) is not run: it is recorded as DRY_RUN, with
  the detail "observe mode: would run restart_service on service sglang (rule service-unhealthy)",
  what the agent would have done (`dispatch.observe_mode`, asked by the remediator before it queues a decision and
  by `execute` before it runs one). It counts as an attempt, as a dry-run rule's does, so the ladder
  moves on to its next steps. The others run: `webhook`, `alertmanager`, `recommend_reboot` (a flag
  file and an alert) and `run_hook` tell people and systems about a fault without the agent touching
  the GPUs or the services, which is what observing is for. A hook runs whatever its owner wrote,
  so an operator who wants nothing run at all does not configure hooks. (Under all of this, the GPU
  backend's write guard refuses a GPU reset in observe mode: agent/backend/base.py.)

Where each action lives
-----------------------
- kinds/: one module per action kind, named for it, declaring it once (`ACTION`, an `ActionType`
  from kind.py: parameters, handler, what it does, whether it changes the node, lane and footprint,
  aim, once per evaluation); registry.py finds them (`KINDS`), and every list of kinds is read from it.
- dispatch.py: `execute`, and `observe_mode`.
- footprint.py: the lane and the GPUs a decision touches, from its kind: what the daemon's action
  worker keeps it apart from.
- service_actions.py: what restart_service and reset_gpu share (which services, their managers,
  draining, starting again, waiting until healthy).
- raise_alert.py: which catalogue alert an alertmanager or recommend_reboot step raises in the
  push book (agent/daemon/alert_book.py); http_client.py: POST with a total deadline, no redirects, no
  secrets in errors (webhook).
- base.py: the result and the error every handler shares; context.py: what a handler reaches;
  steps.py: the steps an action journals, for recovery.
"""
