"""`serve-app chaos`: faults and overload against a real local stack (being split by job)."""

from serve_app.bench.chaos.slow_readers import *  # noqa: F403
from serve_app.bench.chaos.slow_readers import _markdown  # noqa: F401
