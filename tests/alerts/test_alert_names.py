"""The names the config validates `alerts.for_seconds` against (agent/names/alerts.py, below every
package) are the catalogue's, in its order: an alert added to the catalogue without its name there
(or the other way round) fails here, not in an operator's agent.yaml (tests/test_config.py holds an
unknown name refused)."""

from __future__ import annotations

from agent.alerts.catalog import CATALOGUE
from agent.config import AgentConfig
from agent.names.alerts import ALERT_NAMES


def test_the_names_are_the_catalogues() -> None:
    assert tuple(spec.name for spec in CATALOGUE) == ALERT_NAMES


def test_the_config_takes_every_catalogue_name() -> None:
    names = {name: 60.0 for name in ALERT_NAMES}
    assert AgentConfig.model_validate({"alerts": {"for_seconds": names}}).alerts.for_seconds == names
