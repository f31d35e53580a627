"""The advisor's defaults and units, standard library only: `gpu-agent --help` builds the tune
parsers from them without the sweep's models."""

from __future__ import annotations

#: `tune`'s line in `gpu-agent --help`, also when its own parsers are not built.
TUNE_HELP = "measure power limits or locked clocks against the service"

#: The knob each kind turns, its unit, and the policy key it recommends.
KNOB_UNITS: dict[str, str] = {"power": "W", "clocks": "MHz"}
POLICY_ITEMS: dict[str, str] = {"power": "power_limit", "clocks": "locked_clocks"}

DEFAULT_THROUGHPUT_TOLERANCE = 0.05  # the recommendation keeps tokens/s within 5 % of the best seen
DEFAULT_MIN_REQUEST_RATE = 1.0  # requests per second below which a step measures noise
DEFAULT_MAX_TRAFFIC_CHANGE = 0.25  # offered load may move this much between steps
DEFAULT_SETTLE_SECONDS = 10.0  # at most this long for the clocks to settle after a change
