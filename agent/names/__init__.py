"""The names agent.yaml and every layer of the agent share: the policy items (`policy_items.py`) and
the families of `/metrics` (`metric_families.py`) and the
alerts of the catalogue (`alerts.py`). Data only, and below every other package: it
imports nothing of the agent, so the config validates its keys, the backend's write guard names
its setters' items and the exporter switches its families from one list each, without one of them
importing another (tests/test_layout.py holds the package graph acyclic)."""
