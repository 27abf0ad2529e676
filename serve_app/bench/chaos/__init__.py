"""`serve-app chaos`: faults and overload against a real local stack (being split by job)."""

from serve_app.bench.chaos.scenario_slow import *  # noqa: F403
from serve_app.bench.chaos.scenario_slow import _markdown  # noqa: F401
