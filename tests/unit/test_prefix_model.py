"""The cache model of the routing policies (bench/serve_bench/prefix_model.py): the real policies
and replica records over modelled LRU engines, on a small chat workload."""

from __future__ import annotations

from serve_bench.prefix_model import ModelEngine, run_policy
from serve_bench.shared_prefix import SharedPrefix, cached_ceiling, shared_prefix_plan, \
    warmup_requests
from serve_bench.workload import Tenant

TENANTS = [Tenant(f"t{i}", None, 1.0) for i in range(2)]
VOCAB = (1000, 20000)


def _chat(shuffle_span: int) -> tuple[list, list]:
    shape = SharedPrefix(groups=4, prefix_len=128, suffix_len=64, output_len=32, turns=4,
                         sessions=16, skew=1.0, shuffle_span=shuffle_span)
    return (shared_prefix_plan(64, shape, TENANTS, VOCAB, seed=7),
            warmup_requests(shape, TENANTS, VOCAB, seed=7))


def _rate(policy: str, plan: list, warmup: list, **kw: object) -> float:
    return run_policy(policy, plan, warmup, kv_tokens=1 << 20, concurrency=8,
                      block_tokens=16, **kw).hit_rate  # type: ignore[arg-type]


def test_an_engine_keeps_pinned_blocks_and_evicts_the_least_recent_free_ones():
    engine = ModelEngine(kv_tokens=64, block_tokens=16)  # 4 blocks
    a, b = engine.blocks(list(range(48)), "t"), engine.blocks(list(range(100, 148)), "t")
    engine.start(a)
    assert engine.cached(a) == 3
    engine.start(b)  # 6 blocks pinned over a capacity of 4: nothing free to evict
    engine.finish(a)
    engine.finish(b)
    engine.start(engine.blocks(list(range(200, 232)), "t"))  # 2 more: 4 of the 6 free go
    assert engine.cached(a) == 0  # least recent
    assert engine.cached(b) == 2  # its tail first, as vLLM frees a request's blocks
    assert engine.cached(engine.blocks(list(range(48)), "other tenant")) == 0  # salted


def test_lockstep_sessions_flatter_power_of_two_and_a_shuffle_takes_it_away():
    """Requests finishing in order with every pass in one order: power of two alternating over
    two replicas keeps each session on one replica, near prefix_cache and the ceiling. With
    the passes shuffled, power of two loses the histories it kept by accident; prefix_cache,
    which follows them, does not."""
    plan, warmup = _chat(shuffle_span=0)
    ceiling = cached_ceiling(plan, 16, warmup)
    lockstep = _rate("power_of_two", plan, warmup, fifo=True)
    assert lockstep > ceiling - 0.03, (lockstep, ceiling)
    plan, warmup = _chat(shuffle_span=8)
    shuffled = _rate("power_of_two", plan, warmup, fifo=True)
    following = _rate("prefix_cache", plan, warmup, fifo=True)
    assert shuffled < lockstep - 0.05, (shuffled, lockstep)
    assert following > shuffled + 0.05, (following, shuffled)
