"""A cache model of the routing policies on the shared-prefix and chat workloads: what share of
the prompt tokens each policy lets the engines find cached, without a GPU (bench/RESULTS.md 38c).

Real parts: the workload (:mod:`serve_bench.shared_prefix`), the routing policies
(:func:`serve_app.routing.build_policy`), the replicas' records of what they served
(:class:`serve_app.engine.server.ServedBlocks`) and the routers' index built from them (one
router; its feed hands it every replica's report before each choice, as a poll would).
Modelled: each engine's prefix cache, an LRU of ``engine_block_tokens``-token blocks (vLLM's
GPU block) chained and salted by tenant, ``kv_tokens`` in all, where the blocks of requests in
flight are pinned; a closed loop of ``concurrency`` requests in flight, one finishing before
the next is sent, the finishing one drawn at random (``fifo``: the oldest). Power of two
choices (the policy's empty answer) is Serve's: the less loaded of two, ties at random.

No time is modelled: no throughput and no latency, only where requests go and what the
engines hold when they arrive. What it is for: telling a workload's headroom (the ceiling
against power of two) and a policy's share of it apart from the GPU's noise, before a call.

    PYTHONPATH=bench python -m serve_bench.prefix_model [--policies ...] [--orders 6] ...
"""

from __future__ import annotations

import argparse
import random
import statistics
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from serve_app.engine.protocol import EngineLoad, GenerationRequest, SamplingOptions
from serve_app.engine.server import ServedBlocks
from serve_app.governance.keys import Tenant as GovTenant
from serve_app.routing import build_policy
from serve_app.routing.policy import Candidate
from serve_app.routing.prefix_index import index_for
from serve_bench.shared_prefix import (
    SharedPrefix,
    cached_ceiling,
    shared_prefix_plan,
    warmup_requests,
)
from serve_bench.workload import PlannedRequest, Tenant


class ModelEngine:
    """One replica's engine as the cache sees it: an LRU of free cached blocks, and the blocks
    requests in flight pin (never evicted while pinned)."""

    def __init__(self, kv_tokens: int, block_tokens: int) -> None:
        self.capacity = max(1, kv_tokens // block_tokens)
        self.block_tokens = block_tokens
        self.free: OrderedDict[int, None] = OrderedDict()
        self.pinned: dict[int, int] = {}
        self.running = 0

    def blocks(self, ids: list[int], salt: str) -> list[int]:
        out, key = [], hash(salt)
        for i in range(len(ids) // self.block_tokens):
            key = hash((key, tuple(ids[i * self.block_tokens:(i + 1) * self.block_tokens])))
            out.append(key)
        return out

    def cached(self, blocks: list[int]) -> int:
        """Leading blocks held (what vLLM's prefix cache would find)."""
        return next((i for i, b in enumerate(blocks)
                     if b not in self.free and b not in self.pinned), len(blocks))

    def start(self, blocks: list[int]) -> None:
        for b in blocks:
            self.free.pop(b, None)
            self.pinned[b] = self.pinned.get(b, 0) + 1
        self.running += 1
        while len(self.free) + len(self.pinned) > self.capacity and self.free:
            self.free.popitem(last=False)

    def finish(self, blocks: list[int]) -> None:
        """The request's blocks are freed last block first, as vLLM frees them: a prefix's
        tail is evicted before its head."""
        self.running -= 1
        for b in reversed(blocks):
            self.pinned[b] -= 1
            if not self.pinned[b]:
                del self.pinned[b]
                self.free[b] = None


@dataclass(frozen=True)
class ModelRun:
    """One policy's run: the share of prompt tokens found cached, and requests per replica."""

    policy: str
    hit_rate: float
    per_replica: tuple[int, ...]


def run_policy(policy_name: str, plan: list[PlannedRequest], warmup: list[PlannedRequest], *,
               replicas: int = 2, kv_tokens: int = 114_432, concurrency: int = 32,
               engine_block_tokens: int = 16, order_seed: int = 0, fifo: bool = False,
               **knobs: object) -> ModelRun:
    """``plan`` after ``warmup`` (round robin over the replicas) under the policy named."""
    model = f"model-{uuid.uuid4().hex}"  # an index of its own (index_for is per process)
    policy = build_policy(policy_name, model, adapter_replicas=0, **knobs)  # type: ignore[arg-type]
    index = index_for(model)
    ids = [f"replica-{i}" for i in range(replicas)]
    engines = {rid: ModelEngine(kv_tokens, engine_block_tokens) for rid in ids}
    records: dict[str, ServedBlocks] = {}
    rng = random.Random(order_seed)
    served = dict.fromkeys(ids, 0)

    def route(req: PlannedRequest) -> str:
        request = GenerationRequest(f"r{req.index}", SamplingOptions(),
                                    prompt_token_ids=req.prompt_token_ids,
                                    cache_salt=GovTenant(req.tenant.name).cache_salt)
        key = policy.key(request)
        index.apply([EngineLoad(running=engines[rid].running, waiting=0, replica=rid,
                                prefix_report=(records[rid].report(index.known().get(rid))
                                               if rid in records else None)) for rid in ids])
        choice = policy.choose(key, [Candidate(rid, engines[rid].running) for rid in ids]) \
            if key is not None else None
        if choice is not None and choice.ranked:
            rid = choice.ranked[0]
        else:  # Serve's power of two choices: two at random, the less loaded
            pair = rng.sample(ids, min(2, len(ids)))
            low = min(engines[r].running for r in pair)
            rid = rng.choice([r for r in pair if engines[r].running == low])
        policy.routed(rid)
        if request.prefix_hashes:  # the serving replica's record (LLMServer does this)
            size = max(1, request.prefix_block_tokens)
            record = records.setdefault(
                rid, ServedBlocks(max(1, kv_tokens // size)))
            record.record(request.prefix_hashes[1:] if request.session else
                          request.prefix_hashes)
        return rid

    for i, req in enumerate(warmup):
        engine = engines[ids[i % replicas]]
        blocks = engine.blocks(req.prompt_token_ids, req.tenant.name)
        engine.start(blocks)
        engine.finish(blocks)
    in_flight: list[tuple[ModelEngine, list[int]]] = []
    found = total = 0
    for req in plan:
        if len(in_flight) >= concurrency:
            engine, blocks = in_flight.pop(0 if fifo else rng.randrange(len(in_flight)))
            engine.finish(blocks)
        rid = route(req)
        engine = engines[rid]
        blocks = engine.blocks(req.prompt_token_ids, req.tenant.name)
        found += engine.cached(blocks) * engine_block_tokens
        total += len(req.prompt_token_ids)
        engine.start(blocks)
        in_flight.append((engine, blocks))
        served[rid] += 1
    return ModelRun(policy_name, found / total if total else 0.0, tuple(served.values()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", nargs="+", default=["power_of_two", "prefix_cache"])
    p.add_argument("--orders", type=int, default=6,
                   help="finishing orders drawn (each a seed); mean, min and max reported")
    p.add_argument("--fifo", action="store_true", help="requests finish in the order they start")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--kv-tokens", type=int, default=114_432)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--skew", type=float, default=1.0)
    p.add_argument("--session-shuffle", type=int, default=0)
    p.add_argument("--num-requests", type=int, default=384)
    p.add_argument("--seed", type=int, default=100)
    p.add_argument("--imbalance-margin", type=int, default=None)
    p.add_argument("--load-factor", type=float, default=None)
    p.add_argument("--request-cost-tokens", type=int, default=None)
    args = p.parse_args(argv)
    tenants = [Tenant(f"t{i}", None, 1.0) for i in range(4)]
    shape = SharedPrefix(args.groups, args.prefix_len, args.suffix_len, args.output_len,
                         args.turns, args.sessions, args.skew, args.session_shuffle)
    vocab = (1000, 20000)
    plan = shared_prefix_plan(args.num_requests, shape, tenants, vocab, args.seed)
    warmup = warmup_requests(shape, tenants, vocab, args.seed)
    knobs = {k: v for k, v in (("imbalance_margin", args.imbalance_margin),
                                ("load_factor", args.load_factor),
                                ("request_cost_tokens", args.request_cost_tokens))
             if v is not None}
    print(f"ceiling {cached_ceiling(plan, 16, warmup):.3f} ({shape}, c={args.concurrency}, "
          f"{args.replicas} replicas of {args.kv_tokens} KV tokens, "
          f"{'in order' if args.fifo else 'random'} finishing)")
    for name in args.policies:
        runs = [run_policy(name, plan, warmup, replicas=args.replicas, kv_tokens=args.kv_tokens,
                           concurrency=args.concurrency, order_seed=s, fifo=args.fifo,
                           **(knobs if name != "power_of_two" else {}))
                for s in range(args.orders)]
        rates = [r.hit_rate for r in runs]
        print(f"{name:14} hit rate mean {statistics.mean(rates):.3f} min {min(rates):.3f} "
              f"max {max(rates):.3f}  requests per replica {runs[0].per_replica}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
