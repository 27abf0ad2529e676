"""The multi-turn chat shape of the shared-prefix workload (sessions, skewed popularity) and
its ceiling: the share of prompt tokens a perfect router could find cached."""

from __future__ import annotations

from collections import Counter

from serve_bench.shared_prefix import (
    SharedPrefix,
    cached_ceiling,
    shared_prefix_plan,
    warmup_requests,
)
from serve_bench.workload import PlannedRequest, Tenant

TENANTS = [Tenant("a", None, 1.0), Tenant("b", None, 1.0)]
VOCAB = (10, 1000)


def test_sessions_per_round_and_skewed_popularity():
    shape = SharedPrefix(groups=8, prefix_len=32, suffix_len=8, output_len=4, turns=3,
                         sessions=40, skew=1.5)
    plan = shared_prefix_plan(120, shape, TENANTS, VOCAB, seed=1)
    first_turns = plan[:40]  # round one: every session's first turn
    prefixes = Counter(tuple(r.prompt_token_ids[:32]) for r in first_turns)
    assert len(prefixes) <= 8 and max(prefixes.values()) >= 10  # a popular prompt
    # Turn 2 of session i extends its turn 1 (the history grows).
    for one, two in zip(plan[:40], plan[40:80]):
        assert two.prompt_token_ids[:len(one.prompt_token_ids)] == one.prompt_token_ids
        assert len(two.prompt_token_ids) == len(one.prompt_token_ids) + 8 + 4


def test_the_ceiling_counts_each_requests_longest_prefix_seen_before():
    t = TENANTS[0]
    reqs = [PlannedRequest(0, list(range(32)), 1, t, None),
            PlannedRequest(1, list(range(32)) + [7] * 16, 1, t, None),   # 32 of 48 seen
            PlannedRequest(2, [5] + list(range(1, 48)), 1, t, None),     # first block differs
            PlannedRequest(3, list(range(32)), 1, TENANTS[1], None)]    # another tenant
    assert cached_ceiling(reqs, block_tokens=16) == 32 / (32 + 48 + 48 + 32)
    assert cached_ceiling(reqs[1:2], 16, seen_before=reqs[:1]) == 32 / 48
    assert cached_ceiling([], 16) == 0.0


def test_the_shared_workloads_ceiling_is_the_issues():
    """64 groups of 4,096 tokens, 256-token suffixes, after one warm-up per group: the 0.94 the
    issue measured by routing each group to one replica on bare vLLM."""
    shape = SharedPrefix(64, 4096, 256, 128)
    plan = shared_prefix_plan(256, shape, TENANTS, VOCAB, seed=100)
    ceiling = cached_ceiling(plan, seen_before=warmup_requests(shape, TENANTS, VOCAB, 100))
    assert 0.93 < ceiling < 0.95


def test_a_shuffled_pass_moves_sessions_within_their_span_and_keeps_their_histories():
    """Each later pass over the sessions is shuffled within spans of 8 places: a session's next
    turn still extends its own history, comes at least sessions - span + 1 requests after its
    last, and the order differs from pass to pass (no lockstep that hands each session the
    same place every turn)."""
    shape = SharedPrefix(groups=4, prefix_len=16, suffix_len=4, output_len=2, turns=4,
                         sessions=16, shuffle_span=8)
    plan = shared_prefix_plan(64, shape, TENANTS, VOCAB, seed=3)
    latest: dict[int, tuple[list[int], int]] = {}  # session -> (its latest prompt, place)
    orders: list[list[int]] = []
    for place, req in enumerate(plan):
        if place < 16:
            session = place
        else:
            (session,) = [s for s, (ids, _) in latest.items()
                          if req.prompt_token_ids[:len(ids)] == ids]  # its own history only
            assert place - latest[session][1] >= 16 - 8 + 1
        if place % 16 == 0:
            orders.append([])
        orders[-1].append(session)
        latest[session] = (req.prompt_token_ids, place)
    assert all(sorted(o) == list(range(16)) for o in orders)  # every session once a pass
    assert all(set(o[:8]) == set(range(8)) for o in orders)  # each keeps its span
    assert len({tuple(o) for o in orders}) == 4  # no two passes in the same order


def test_an_unshuffled_plan_is_unchanged_by_the_option_regression_lockstep():
    """Span 0 (and 1) keep every pass in the first pass's order, as the 38b runs had it."""
    base = SharedPrefix(groups=4, prefix_len=16, suffix_len=4, output_len=2, turns=3,
                        sessions=8)
    for span in (0, 1):
        shape = SharedPrefix(4, 16, 4, 2, 3, 8, shuffle_span=span)
        assert shared_prefix_plan(24, shape, TENANTS, VOCAB, 5) == \
            shared_prefix_plan(24, base, TENANTS, VOCAB, 5)
