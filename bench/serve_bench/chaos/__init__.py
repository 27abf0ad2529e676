"""`serve-app chaos` (`make chaos`): faults and overload against a real local stack, with figures.

Starts the embedded default (tiny model, vLLM CPU engine) reshaped by :mod:`.stack` (two engine
replicas of a small batch, a short router queue, two tenants) through
:func:`serve_app.launch.start_stack`, and runs, each against bounds it checks itself:

1. **disconnect storm** (:mod:`.scenario_storm`): 200 requests abandoned by their clients while
   the engines are saturated; the stack holds nothing again within 5 s.
2. **replica kill** (:mod:`.scenario_kill`): one engine replica killed under 50 streams; only
   the victim's requests fail, each with a terminal signal; the replacement serves; no orphans.
3. **overload** (:mod:`.scenario_overload`): 5x the engines' capacity; the excess is refused
   with Retry-After in under 100 ms at p99, no 500s, no restarts, recovery within 30 s.
4. **slow readers** (:mod:`.scenario_slow`): streams read a byte a second are cut by the stall
   watch, and another tenant's streams beside them keep their ITL and TTFT.

:mod:`.target` holds the client and the white-box probes the scenarios share, :mod:`.report`
the verdicts and the ``chaos.json``/``chaos.md`` report, :mod:`.cli` the subcommand's flags
and run (exit 1 if a bound is missed). The figures go to bench/RESULTS.md with the command
that produced them. The names below are the package's public surface.
"""

from serve_bench.chaos.cli import add_arguments, main
from serve_bench.chaos.report import Scenario, write_report
from serve_bench.chaos.report import _markdown  # noqa: F401 (the unit test renders with it)
from serve_bench.chaos.scenario_kill import replica_kill
from serve_bench.chaos.scenario_overload import overload
from serve_bench.chaos.scenario_slow import slow_readers
from serve_bench.chaos.scenario_storm import disconnect_storm
from serve_bench.chaos.stack import (BATCH, HEADROOM, QUEUE, REPLICAS, STALL_S, TENANTS,
                                         chaos_config)
from serve_bench.chaos.target import REFUSED, Result, Target, request

__all__ = ["BATCH", "HEADROOM", "QUEUE", "REFUSED", "REPLICAS", "STALL_S", "TENANTS", "Result",
           "Scenario", "Target", "add_arguments", "chaos_config", "disconnect_storm",
           "main", "overload", "replica_kill", "request", "slow_readers", "write_report"]
