"""The power and clock advisor: `gpu-agent tune power|clocks` measures what a setting costs.

The daemon runs a sweep as one journaled job beside the remediation actions (never on its loop):
it holds the policy loop off the swept GPUs' item, sets each step's power limit (or locked
graphics clock), waits for the clocks to settle, measures over the dwell, and puts the original
settings back when it ends, when it is aborted (`gpu-agent tune --abort`, Ctrl-C on the CLI,
SIGTERM to the daemon, a remediation that needs the node) and, through the journal, after a
kill -9 (the next start rolls it back before the policy loop may touch those GPUs).

| module | what it holds |
|---|---|
| `model.py` | the request, a step's readings, the result and its recommendation (JSON documents) |
| `measure.py` | one step: the GPUs' energy counters, clocks, temperatures and reasons over the dwell; |
| | the server's token counter and latency histograms from its own `/metrics` (services.scrape) |
| `recommend.py` | pure: traffic too thin or too uneven, the SLO per step (services.latency_cause), |
| | the recommendation, its policy snippet and expected change |
| `sweep.py` | the job: hold, set, settle, measure, stop on an SLO breach, restore; the journal rows |
| `runner.py` | the daemon side: preflight refusals, the job on the action worker, recovery at start, the API methods |
| `passive.py` | advice without changes, from the per-limit history the daemon keeps |
| `cli.py` | `gpu-agent tune`: start, progress, abort, the table |
"""
