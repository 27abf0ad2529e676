"""The bench's shared-prefix workload: groups, prefixes, suffixes, tenants, sessions."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest

from serve_bench.runner import add_arguments, shared_prefix_shape
from serve_bench.shared_prefix import (
    SharedPrefix,
    group_prefix,
    shared_prefix_plan,
    tenant_groups,
    warmup_requests,
)
from serve_bench.workload import Tenant

VOCAB = (10, 5000)
A, B = Tenant("a", None, 0.7), Tenant("b", None, 0.3)


def _group_of(prompt: list[int], shape: SharedPrefix) -> int:
    return next(g for g in range(shape.groups)
                if prompt[:shape.prefix_len] == group_prefix(g, shape.prefix_len, VOCAB, 0))


def test_every_request_is_a_group_prefix_and_a_unique_suffix():
    shape = SharedPrefix(groups=4, prefix_len=32, suffix_len=8, output_len=5)
    reqs = shared_prefix_plan(40, shape, [A], VOCAB)
    assert len(reqs) == 40
    assert all(len(r.prompt_token_ids) == 40 and r.max_tokens == 5 for r in reqs)
    assert {_group_of(r.prompt_token_ids, shape) for r in reqs} == {0, 1, 2, 3}
    suffixes = [tuple(r.prompt_token_ids[32:]) for r in reqs]
    assert len(set(suffixes)) == len(suffixes)


def test_prefixes_differ_from_the_first_token_and_repeat_across_runs():
    firsts = {group_prefix(g, 16, VOCAB, 0)[0] for g in range(20)}
    assert len(firsts) > 15  # a key on the leading block tells groups apart
    assert group_prefix(3, 16, VOCAB, 0) == group_prefix(3, 16, VOCAB, 0)
    assert shared_prefix_plan(5, SharedPrefix(2, 8, 4, 2), [A], VOCAB, seed=1) == \
        shared_prefix_plan(5, SharedPrefix(2, 8, 4, 2), [A], VOCAB, seed=1)


def test_groups_belong_to_tenants_and_shares_pick_the_tenant():
    shape = SharedPrefix(groups=6, prefix_len=8, suffix_len=4, output_len=2)
    owned = tenant_groups(shape, [A, B])
    assert owned == {"a": [0, 2, 4], "b": [1, 3, 5]}
    reqs = shared_prefix_plan(2000, shape, [A, B], VOCAB)
    assert all(_group_of(r.prompt_token_ids, shape) in owned[r.tenant.name] for r in reqs)
    share = Counter(r.tenant.name for r in reqs)["a"] / len(reqs)
    assert 0.65 < share < 0.75
    with pytest.raises(ValueError, match="at least one group"):
        tenant_groups(SharedPrefix(1, 8, 4, 2), [A, B])


def test_sessions_grow_their_history_turn_by_turn():
    shape = SharedPrefix(groups=3, prefix_len=8, suffix_len=4, output_len=2, turns=3)
    reqs = shared_prefix_plan(9, shape, [A], VOCAB)
    # Round by round: three sessions' first turns, then their second, then their third.
    assert [len(r.prompt_token_ids) for r in reqs] == [12] * 3 + [18] * 3 + [24] * 3
    for s in range(3):
        turns = [reqs[s].prompt_token_ids, reqs[3 + s].prompt_token_ids,
                 reqs[6 + s].prompt_token_ids]
        # Each turn starts with the whole previous turn (plus the stand-in answer).
        assert turns[1][:12] == turns[0] and turns[2][:18] == turns[1]


def test_warmup_is_one_request_per_group_as_its_tenant():
    shape = SharedPrefix(groups=4, prefix_len=8, suffix_len=4, output_len=2)
    warm = warmup_requests(shape, [A, B], VOCAB)
    assert [_group_of(r.prompt_token_ids, shape) for r in warm] == [0, 1, 2, 3]
    assert [r.tenant.name for r in warm] == ["a", "b", "a", "b"]


def test_the_command_line_builds_the_shape():
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--prefix-groups", "64", "--prefix-len", "4096", "--input-len", "256",
                         "--output-len", "128", "--turns", "2"])
    assert shared_prefix_shape(args, (256, 256), (128, 128)) == SharedPrefix(64, 4096, 256, 128, 2)
    assert shared_prefix_shape(p.parse_args([]), (128, 128), (128, 128)) is None
    with pytest.raises(SystemExit, match="one number"):
        shared_prefix_shape(args, (16, 256), (128, 128))
