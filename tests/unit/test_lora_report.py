"""bench/lora_report.py's pure parts: adapter swaps per replica from Ray's metrics page, their
deltas over a run, and the affinity part's table."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the report imports its neighbours (prefix_affinity_report)
_SPEC = importlib.util.spec_from_file_location("lora_report", BENCH / "lora_report.py")
report = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(report)

PAGE = """\
# TYPE ray_serve_app_adapter_swaps_total counter
ray_serve_app_adapter_swaps_total{adapter="a0",application="serve-app",deployment="LLMServer:m",event="load",model="m",replica="r1"} 3.0
ray_serve_app_adapter_swaps_total{adapter="a1",application="serve-app",deployment="LLMServer:m",event="load",model="m",replica="r1"} 2.0
ray_serve_app_adapter_swaps_total{adapter="a0",application="serve-app",deployment="LLMServer:m",event="evict",model="m",replica="r1"} 1.0
ray_serve_app_adapter_swaps_total{adapter="a2",application="serve-app",deployment="LLMServer:m",event="load",model="m",replica="r2"} 1.0
ray_serve_app_adapter_swaps_created{adapter="a2",event="load",model="m",replica="r2"} 1.7e9
ray_vllm_request_success_total{ReplicaId="r1"} 9.0
"""


def test_swaps_per_replica_and_event():
    assert report.parse_swaps(PAGE) == {"r1": {"load": 5.0, "evict": 1.0},
                                        "r2": {"load": 1.0, "evict": 0.0}}


def test_swap_deltas_count_a_replica_new_since_before():
    before = {"r1": {"load": 2.0, "evict": 0.0}}
    after = {"r1": {"load": 5.0, "evict": 1.0}, "r2": {"load": 1.0, "evict": 0.0}}
    assert report.swap_deltas(before, after) == {"r1": {"load": 3.0, "evict": 1.0},
                                                 "r2": {"load": 1.0, "evict": 0.0}}


def _arm(root: Path, name: str, ttft: float, tput: float, loads: float) -> None:
    d = root / name
    d.mkdir()
    dist = {"median": ttft, "p99": 2 * ttft}
    summary = {"ttft_ms": dist, "tpot_ms": {"median": 10.0}, "output_throughput": tput,
               "failed": 0}
    (d / "results.json").write_text(json.dumps({"runs": [{"summary": summary}]}))
    (d / "swaps-before.json").write_text(json.dumps({"r1": {"load": 1.0, "evict": 0.0}}))
    (d / "swaps-after.json").write_text(json.dumps({"r1": {"load": 1.0 + loads, "evict": 0.0}}))
    zero = {"queries": 0.0, "hits": 0.0, "finished": 0.0}
    (d / "before.json").write_text(json.dumps({"r1": zero, "r2": zero}))
    (d / "after.json").write_text(json.dumps({"r1": {**zero, "finished": 6.0},
                                              "r2": {**zero, "finished": 4.0}}))
    per_replica = [{"replica": "r1", "adapters": ["a0", "a1"]}, {"replica": "r2", "adapters": []}]
    (d / "status.json").write_text(json.dumps({"models": {"m": {"per_replica": per_replica}}}))


def test_affinity_table_rows_and_ratios_over_repeats(tmp_path):
    _arm(tmp_path, "1-power_of_two", 100.0, 1000.0, 40)
    _arm(tmp_path, "2-prefix_cache", 50.0, 1200.0, 4)
    _arm(tmp_path, "3-prefix_cache", 70.0, 1200.0, 6)
    _arm(tmp_path, "4-power_of_two", 100.0, 1000.0, 20)
    text = report.affinity_table(tmp_path)
    # r2 never swapped (its counter is registered on its first swap): still its own entry.
    assert ("| 1 | power_of_two | 100.0 | 200.0 | 1000 | 10.00 | 40 / 0 | r1: 40 / 0, 6 req, "
            "a0 a1; r2: 0 / 0, 4 req, none | 0 |") in text
    assert ("prefix_cache / power_of_two (2 and 2 arm(s), means): TTFT p50 **0.60x**" in text)
    assert "output throughput **1.20x**, adapter loads per arm 30 -> 5" in text


def test_read_swaps_sums_every_agent_and_skips_one_that_does_not_answer(tmp_path):
    """The shared agent reader (prefix_affinity_report.read_agents): two agents serving the
    page are summed per replica; a target that refuses the connection is skipped."""
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = PAGE.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Page) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        dead = free.getsockname()[1]
    targets = [f"127.0.0.1:{s.server_address[1]}" for s in servers] + [f"127.0.0.1:{dead}"]
    sd = tmp_path / "sd.json"
    sd.write_text(json.dumps([{"targets": targets}]))
    try:
        assert report.read_swaps(str(sd)) == {"r1": {"load": 10.0, "evict": 2.0},
                                              "r2": {"load": 2.0, "evict": 0.0}}
    finally:
        for s in servers:
            s.shutdown()
