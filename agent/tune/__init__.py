"""The power and clock advisor: `gpu-agent tune power|clocks` measures what a setting costs.

The daemon runs a sweep as one journaled job beside the remediation actions (never on its loop,
never in the way of an alert or of a repair on other GPUs), inside a hardware transaction
(agent/policy/holds.py): it holds the policy loop off the swept GPUs' item, reads and journals the
originals, sets each step's power limit (or locked graphics clock), waits for the clocks to settle,
measures over the dwell, and the originals go back on every way out: the end, an abort
(`gpu-agent tune --abort`, Ctrl-C on the CLI, SIGTERM to the daemon, a remediation that needs those
GPUs), an error of any type, a reload that takes the write away or drops the service, and, through
the journal, a kill -9 (the next start puts them back before the policy loop may touch those GPUs).
A request that could take over two hours, a step a GPU does not accept, or (unless --force) a sick
subject is refused before anything starts. A recommendation goes in force as a policy drop-in and
comes out again in one step (`gpu-agent tune apply`, `undo`).

| module | what it holds |
|---|---|
| `model.py` | the request, a step's readings, the result and its recommendation (JSON documents) |
| `measure.py` | one step: the GPUs' energy counters, clocks, temperatures and reasons over the dwell; |
| | the server's token counter and latency histograms from its own `/metrics` (services.scrape) |
| `recommend.py` | pure: traffic too thin or too uneven, the SLO per step (services.latency_cause), |
| | the recommendation (its rule, the edge of the range, the trade-off), its snippet and expected change |
| `preflight.py` | the checks before a sweep starts (the board's range, a sick subject), the swept GPUs as found |
| `sweep.py` | the job, run inside a hardware transaction: set, settle, measure, stop on an SLO breach; its row |
| `runner.py` | the daemon side: preflight refusals (the sweep's length too), the job on the action worker, |
| | closing the rows a killed run left, the API methods |
| `passive.py` | advice without changes, from the history the daemon keeps per limit and traffic band |
| `apply.py` | `gpu-agent tune apply` / `undo`: the drop-in beside agent.yaml, checked, written, reloaded |
| `cli.py` | `gpu-agent tune`: start, progress, abort, the table |
"""
