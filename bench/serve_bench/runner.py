"""``serve-app bench``: drive an OpenAI endpoint and write JSON, Markdown and PNG results.

Each concurrency of the sweep is one run: a warm-up that is not counted, then the measured
requests. ``--static-vs-continuous B`` adds the batching comparison at batch size B.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import shlex
import sys
from pathlib import Path
from typing import Any

from serve_bench import report
from serve_bench.client import Progress, Target, run_concurrency, run_static
from serve_bench.stats import SLO, service_over_time, summarize, summarize_by_tenant
from serve_bench.shared_prefix import (
    SharedPrefix,
    cached_ceiling,
    iter_shared_prefix,
    shared_prefix_plan,
    warmup_requests,
)
from serve_bench.workload import iter_plan, parse_length, parse_tenants, plan


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server, without /v1")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--input-len", default="128", help="prompt tokens: N or LO-HI")
    p.add_argument("--output-len", default="128", help="output tokens: N or LO-HI (ignore_eos)")
    p.add_argument("--token-range", default="10-250",
                   help="prompt token ids are drawn uniformly from LO-HI (inclusive)")
    p.add_argument("--num-requests", default="200",
                   help="measured requests per run: one number, or one per concurrency (a,b,c)")
    p.add_argument("--duration", type=float, default=None,
                   help="stop starting requests after this many seconds of a run (requests are "
                   "drawn as they are sent; --num-requests does not bound such a run)")
    p.add_argument("--concurrency", default="1,8,32",
                   help="comma-separated concurrency caps; one run each")
    p.add_argument("--rate", type=float, default=None,
                   help="request rate (req/s) with gamma gaps; the cap still applies")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--warmup", type=int, default=None,
                   help="uncounted requests before each run (default: the concurrency, min 2)")
    p.add_argument("--tenant", action="append", default=[],
                   help="name:api_key:share[:model], repeatable (multi-tenant mix); model: the "
                   "`model` of the tenant's requests (a LoRA adapter's name; default --model)")
    p.add_argument("--prefix-groups", type=int, default=0, metavar="N",
                   help="shared-prefix mode: N groups (spread over the tenants round-robin), "
                   "each with its own prefix of --prefix-len tokens; every request is its "
                   "group's prefix plus a unique suffix of --input-len tokens. The warm-up is "
                   "one request per group (unless --warmup)")
    p.add_argument("--warmup-only", action="store_true",
                   help="send the first run's warm-up and stop (nothing measured or written): "
                   "a script can read the engines' counters between the warm-up and the run, "
                   "which it then starts with --warmup 0")
    p.add_argument("--prefix-len", type=int, default=1024, metavar="P",
                   help="shared-prefix mode: tokens of each group's prefix")
    p.add_argument("--turns", type=int, default=1,
                   help="shared-prefix mode: turns per session; each turn's prompt holds the "
                   "earlier turns (suffix + an output-length answer), so history grows")
    p.add_argument("--sessions", type=int, default=0,
                   help="shared-prefix mode: sessions per round (default: one per group); "
                   "with --turns, many conversations over a few system prompts")
    p.add_argument("--prefix-skew", type=float, default=0.0,
                   help="shared-prefix mode: Zipf exponent of the groups' popularity within a "
                   "tenant (0: uniform)")
    p.add_argument("--session-shuffle", type=int, default=0, metavar="SPAN",
                   help="shared-prefix mode with --turns: shuffle each later pass over the "
                   "sessions within spans of SPAN places, as independent users' turns have no "
                   "fixed order; a session's next turn still comes at least sessions - SPAN + 1 "
                   "requests after its last (keep that above --concurrency). 0: every pass in "
                   "the same order")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2el-ms", type=float, default=None)
    p.add_argument("--static-vs-continuous", type=int, default=None, metavar="B",
                   help="also compare static batches of B with B in flight continuously")
    p.add_argument("--batching-output-len", default="16-256",
                   help="output lengths of the batching comparison (mixed)")
    p.add_argument("--service-bin-s", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="serve-app bench")
    p.add_argument("--out", default="bench/out", help="folder for results.json, summary.md, PNGs")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    target = Target(args.base_url.rstrip("/"), args.model, args.endpoint)
    tenants = parse_tenants(args.tenant)
    in_len, out_len = parse_length(args.input_len), parse_length(args.output_len)
    lo, hi = parse_length(args.token_range)
    vocab = (lo, hi + 1)
    slo = None
    if args.slo_ttft_ms or args.slo_tpot_ms or args.slo_e2el_ms:
        slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2el_ms)
    progress_on = None if not args.quiet else False
    runs: list[dict[str, Any]] = []
    service: dict[str, Any] = {}
    caps = [int(c) for c in args.concurrency.split(",")]
    counts = [int(x) for x in str(args.num_requests).split(",")]
    if len(counts) not in (1, len(caps)):
        raise SystemExit("--num-requests: give one number or one per concurrency")
    counts = counts * len(caps) if len(counts) == 1 else counts
    shape = shared_prefix_shape(args, in_len, out_len)
    for i, conc in enumerate(caps):
        # A run bounded by time draws requests until it ends; --num-requests bounds the others.
        n = counts[i] if args.duration is None else None
        warm = args.warmup if args.warmup is not None else max(conc, 2)
        if shape is not None:
            # The prefixes are the same in every run (seeded by --seed, not by the run).
            warmup = (warmup_requests(shape, tenants, vocab, args.seed) if args.warmup is None
                      else shared_prefix_plan(warm, shape, tenants, vocab, args.seed + 1000 + i))
            if warmup:
                await run_concurrency(target, warmup, conc)
            if args.warmup_only:
                return {}
            reqs = iter_shared_prefix(n, shape, tenants, vocab, seed=args.seed, rate=args.rate,
                                      burstiness=args.burstiness)
        else:
            if warm:
                await run_concurrency(target, plan(warm, in_len, out_len, tenants, vocab,
                                                   seed=args.seed + 1000 + i), conc)
            if args.warmup_only:
                return {}
            reqs = iter_plan(n, in_len, out_len, tenants, vocab, seed=args.seed + i,
                             rate=args.rate, burstiness=args.burstiness)
        label = f"c={conc}" + (f" rate={args.rate}" if args.rate else "")
        sent: list[Any] = []
        if shape is not None:  # keep what is sent, for the workload's ceiling
            reqs = _kept(reqs, sent)
        records, wall = await run_concurrency(
            target, reqs, conc, Progress(n or 0, label, progress_on), args.duration)
        t0 = min(r.start for r in records)
        ceiling = None
        if shape is not None:  # the group warm-up counts as sent (default or --warmup-only)
            ceiling = cached_ceiling(sent, seen_before=warmup_requests(shape, tenants, vocab,
                                                                       args.seed))
        runs.append({
            "name": label, "concurrency": conc, "rate": args.rate, "prefix_ceiling": ceiling,
            "summary": summarize(records, wall, slo),
            "tenants": summarize_by_tenant(records, wall, slo),
            "records": [r.to_dict() for r in records],
        })
        service = {"run": label, "bin_s": args.service_bin_s,
                   "series": service_over_time(records, t0, args.service_bin_s)}
    result: dict[str, Any] = {
        "label": args.label,
        "command": "serve-app bench " + " ".join(shlex.quote(a) for a in redact_keys(sys.argv[2:])),
        "target": f"{target.base_url}{target.endpoint} model={target.model}",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "workload": (f"input {args.input_len} tokens" if shape is None else
                     f"shared prefix: {shape.groups} groups of {shape.prefix_len} tokens, unique "
                     f"suffix {shape.suffix_len} tokens, {shape.turns} turn(s) per session"
                     + (f", {shape.sessions} sessions per round" if shape.sessions else "")
                     + (f", popularity skew {shape.skew:g}" if shape.skew else "")
                     + (f", each pass shuffled in spans of {shape.shuffle_span}"
                        if shape.shuffle_span > 1 else ""))
                    + f", output {args.output_len} tokens (ignore_eos), {args.num_requests} "
                    f"requests per run, tenants "
                    f"{[t.name + (f' -> {t.model}' if t.model else '') for t in tenants]}",
        "runs": runs,
        "service_over_time": service,
    }
    if args.static_vs_continuous:
        result["static_vs_continuous"] = await _batching(args, target, tenants, in_len, vocab)
    return result


def shared_prefix_shape(args: argparse.Namespace, in_len: tuple[int, int],
                        out_len: tuple[int, int]) -> SharedPrefix | None:
    """The shared-prefix workload the arguments ask for (None: ``--prefix-groups`` 0). Its
    suffix and output lengths are --input-len and --output-len, each one number."""
    if not args.prefix_groups:
        return None
    if in_len[0] != in_len[1] or out_len[0] != out_len[1]:
        raise SystemExit("shared-prefix mode: give --input-len (the suffix) and --output-len "
                         "as one number each")
    try:
        return SharedPrefix(args.prefix_groups, args.prefix_len, in_len[0], out_len[0],
                            args.turns, args.sessions, args.prefix_skew, args.session_shuffle)
    except ValueError as err:
        raise SystemExit(str(err)) from None


def _kept(reqs: Any, sent: list[Any]) -> Any:
    """``reqs`` as drawn, each also appended to ``sent``."""
    for req in reqs:
        sent.append(req)
        yield req


def redact_keys(argv: list[str]) -> list[str]:
    """``argv`` with the API keys of ``--tenant name:key:share[:model]`` replaced by ``***``
    (results files are shared; keys must not be in them)."""
    def redacted(spec: str) -> str:
        name, key, *rest = spec.split(":", 3)
        return ":".join([name, "***" if key else "", *rest])

    out: list[str] = []
    for i, a in enumerate(argv):
        prev = argv[i - 1] if i else ""
        if a.startswith("--tenant=") and a.count(":") >= 2:
            a = "--tenant=" + redacted(a[len("--tenant="):])
        elif prev == "--tenant" and a.count(":") >= 2:
            a = redacted(a)
        out.append(a)
    return out


async def _batching(args: argparse.Namespace, target: Target, tenants: list[Any],
                    in_len: tuple[int, int], vocab: tuple[int, int]) -> dict[str, Any]:
    """Same requests (mixed output lengths), as static batches and as continuous load."""
    b = args.static_vs_continuous
    out_len = parse_length(args.batching_output_len)
    n = int(str(args.num_requests).split(",")[-1])
    reqs = plan(n, in_len, out_len, tenants, vocab, seed=args.seed + 7)
    await run_concurrency(target, reqs[:b], b)  # warm-up
    progress_on = None if not args.quiet else False
    s_rec, s_wall = await run_static(target, reqs, b, Progress(len(reqs), "static", progress_on))
    c_rec, c_wall = await run_concurrency(target, reqs, b,
                                          Progress(len(reqs), "continuous", progress_on))
    static, cont = summarize(s_rec, s_wall), summarize(c_rec, c_wall)
    return {"batch": b, "output_len": args.batching_output_len, "static": static,
            "continuous": cont,
            "ratio": cont["output_throughput"] / max(static["output_throughput"], 1e-9)}


def main(args: argparse.Namespace) -> int:
    result = asyncio.run(_bench(args))
    if args.warmup_only:
        return 0
    paths = report.write(result, Path(args.out))
    print(report.markdown(result))
    print("wrote " + ", ".join(str(p) for p in paths))
    failed = sum(r["summary"]["failed"] for r in result["runs"])
    return 1 if failed else 0
