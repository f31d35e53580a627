"""gpu-agent's alerts: one catalogue (`catalog.py`, conditions in `expr.py`) that the shipped
Prometheus rules are written from (`rules_file.py`, `python -m agent.alerts`) and that the agent
evaluates over its own `/metrics` samples (`evaluate.py`) to push the same alerts to Alertmanager
(`book.py`, the state of each pushed alert, kept in the store; agent/daemon/alert_delivery.py sends
them)."""
