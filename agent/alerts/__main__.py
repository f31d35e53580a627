"""`python -m agent.alerts [--job NAME] [--runbook-url URL]`: the Prometheus alert rules on stdout;
`--runbooks`: the alerts' sections of docs/alerts.md instead."""

from __future__ import annotations

import argparse
import sys

from agent.alerts.rules_file import alert_rules, runbooks
from agent.names.alerts import DEFAULT_JOB, DEFAULT_RUNBOOK_URL


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m agent.alerts", description=__doc__)
    parser.add_argument("--job", default=DEFAULT_JOB, help=f"the job gpu-agent is scraped under ({DEFAULT_JOB})")
    parser.add_argument(
        "--runbook-url", default=DEFAULT_RUNBOOK_URL, help=f"where docs/alerts.md is served ({DEFAULT_RUNBOOK_URL})"
    )
    parser.add_argument("--runbooks", action="store_true", help="the runbook sections of docs/alerts.md instead")
    args = parser.parse_args()
    sys.stdout.write(runbooks() if args.runbooks else alert_rules(args.job, args.runbook_url))


if __name__ == "__main__":
    main()
