"""The token path without a GPU: the real router, Serve, HAProxy and LLMServer in front of the
scripted engine (one token per running request every ``--step-ms``, as a busy GPU engine
steps), with the output channels on and off. Per arm: ITL p50 against the engine's step, and
the CPU time the LLMServer replica and the router spend per streamed chunk (all chunks of the
run, from /proc), optionally a py-spy profile of both (``--py-spy PATH``).

usage: python bench/stream_cpu.py [--streams 128] [--output-len 64] [--step-ms 20]
                                 [--arms channels,per-chunk] [--py-spy PATH] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from serve_app.config import ModelSettings, load_config  # noqa: E402
from serve_app.engine.scripted import SCRIPTED_ENGINE_CLASS  # noqa: E402
from serve_app.launch import start_stack, stop_stack, wait_until_serving  # noqa: E402

MODEL = "scripted"


def _process(part: str) -> psutil.Process | None:
    """The Serve replica process of deployment ``part`` (its title names it)."""
    for proc in psutil.process_iter(["cmdline"]):
        if any(f":{part}" in arg and "ServeReplica" in arg for arg in proc.info["cmdline"] or []):
            return proc
    return None


def _cpu_s(proc: psutil.Process | None) -> float:
    if proc is None:
        return float("nan")
    t = proc.cpu_times()
    return t.user + t.system


def run_arm(arm: str, a: argparse.Namespace, out: Path) -> dict:
    cfg = load_config(REPO / "deployments" / "local-cpu.yaml")
    model = ModelSettings(name=MODEL, path=str(REPO / "models" / "tiny-llama"), device="cpu",
                          max_ongoing_requests=4 * a.streams, max_model_len=4096,
                          engine_kwargs={"max_num_seqs": 2 * a.streams,
                                         "scripted_step_s": a.step_ms / 1000})
    router = cfg.router.model_copy(update={"output_channels": arm == "channels"})
    cfg = cfg.model_copy(update={"models": [model], "router": router})
    base = start_stack(cfg, engine_class=SCRIPTED_ENGINE_CLASS, num_cpus=4)
    try:
        wait_until_serving(base, timeout_s=120, interval_s=0.5)
        replica, router_proc = _process("LLMServer"), _process("Router")
        bench = [sys.executable, "-m", "serve_app.cli", "bench", "--base-url", base,
                 "--model", MODEL, "--input-len", "16", "--output-len", str(a.output_len),
                 "--num-requests", str(2 * a.streams), "--concurrency", str(a.streams),
                 "--warmup", "4", "--quiet", "--label", f"{arm} (scripted engine)",
                 "--out", str(out / arm)]
        before = (_cpu_s(replica), _cpu_s(router_proc))
        load = subprocess.Popen(bench, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        if a.py_spy:
            time.sleep(3)
            spies = [subprocess.Popen([a.py_spy, "record", "--nonblocking", "-p", str(p.pid),
                                       "-d", str(a.profile_s), "-r", "100", "-f", "raw", "-o",
                                       str(out / f"{arm}-{name}.pyspy.txt")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for name, p in (("LLMServer", replica), ("Router", router_proc)) if p]
            for spy in spies:
                spy.wait()
        load.wait()
        after = (_cpu_s(replica), _cpu_s(router_proc))
        result = json.loads((out / arm / "results.json").read_text())
        s = result["runs"][0]["summary"]
        chunks = sum(len(r["itl"]) + 1 for r in result["runs"][0]["records"] if r.get("itl"))
        return {"arm": arm, "output_tok_s": s["output_throughput"],
                "itl_p50_ms": s["itl_ms"]["median"], "ttft_p50_ms": s["ttft_ms"]["median"],
                "step_ms": a.step_ms, "chunks": chunks,
                "replica_cpu_us_per_chunk": (after[0] - before[0]) / max(chunks, 1) * 1e6,
                "router_cpu_us_per_chunk": (after[1] - before[1]) / max(chunks, 1) * 1e6}
    finally:
        stop_stack()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--arms", default="channels,per-chunk",
                        help="comma-separated; each arm runs in a process of its own (write "
                        "`--arms A,B`, not `--arms=A,B`)")
    parser.add_argument("--py-spy", default=None, help="py-spy binary: profile both processes")
    parser.add_argument("--profile-s", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "stream-cpu")
    a = parser.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    arms = a.arms.split(",")
    if len(arms) == 1:
        row = run_arm(arms[0], a, a.out)
        (a.out / f"{arms[0]}.json").write_text(json.dumps(row))
        return
    # One process (and one fresh Ray instance) per arm: nothing of one arm's stack is left
    # for the next to measure.
    rows = []
    argv = list(sys.argv[1:])
    if "--arms" in argv:
        i = argv.index("--arms")
        del argv[i:i + 2]
    for arm in arms:
        subprocess.run([sys.executable, __file__, *argv, "--arms", arm], check=True)
        rows.append(json.loads((a.out / f"{arm}.json").read_text()))
    print(f"| arm | streams | engine step ms | out tok/s | ITL p50 ms | TTFT p50 ms | chunks "
          f"| replica CPU us/chunk | router CPU us/chunk |\n{'| --- ' * 9}|")
    for r in rows:
        print(f"| {r['arm']} | {a.streams} | {r['step_ms']:g} | {r['output_tok_s']:.0f} | "
              f"{r['itl_p50_ms']:.1f} | {r['ttft_p50_ms']:.1f} | {r['chunks']} | "
              f"{r['replica_cpu_us_per_chunk']:.0f} | {r['router_cpu_us_per_chunk']:.0f} |")
    (a.out / "summary.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
