"""The prefix-affinity policy's pure logic: keys, rendezvous agreement, the load bound."""

from __future__ import annotations

import random

import pytest

from serve_app.engine.protocol import GenerationRequest, SamplingOptions
from serve_app.routing import build_policy
from serve_app.routing.policy import Candidate
from serve_app.routing.prefix_affinity import PrefixAffinity, rendezvous_order
from serve_app.routing.prefix_key import PrefixKeyer, chat_text

KEYER = PrefixKeyer(block_tokens=4, prefix_blocks=2, chars_per_token=2)  # blocks of 8 chars


def _req(salt: str | None = "tenant-a", **prompt: object) -> GenerationRequest:
    return GenerationRequest("r", SamplingOptions(), cache_salt=salt, **prompt)  # type: ignore[arg-type]


def _policy(margin: int = 4, factor: float = 1.25) -> PrefixAffinity:
    return PrefixAffinity(KEYER, imbalance_margin=margin, load_factor=factor)


def _idle(*ids: str) -> list[Candidate]:
    return [Candidate(i, 0) for i in ids]


# Keys --------------------------------------------------------------------------------------

def test_requests_sharing_the_leading_blocks_share_a_key():
    shared = "S" * 16  # two blocks of 8 characters: the whole key
    assert KEYER.key(_req(prompt=shared + "question one")) == \
        KEYER.key(_req(prompt=shared + "another, longer question"))
    assert KEYER.key(_req(prompt=shared + "x")) != KEYER.key(_req(prompt="T" + shared[1:] + "x"))


def test_the_salt_separates_tenants_with_identical_prompts():
    prompt = "the same long system prompt for everyone"
    a, b = KEYER.key(_req("tenant-a", prompt=prompt)), KEYER.key(_req("tenant-b", prompt=prompt))
    assert a is not None and b is not None and a != b
    assert KEYER.key(_req(None, prompt=prompt)) not in (a, b)
    # The salt's length is hashed: a salt that runs into the prompt is another key.
    assert KEYER.key(_req("ab", prompt="c" * 16)) != KEYER.key(_req("a", prompt="bc" + "c" * 14))


def test_a_prompt_under_one_block_has_no_key():
    assert KEYER.key(_req(prompt="short")) is None  # 5 characters < 8
    assert KEYER.key(_req(prompt_token_ids=[1, 2, 3])) is None  # 3 ids < 4
    assert KEYER.key(_req(messages=[])) is None
    assert KEYER.key(None) is None
    assert KEYER.key(_req(prompt="exactly8")) is not None


def test_a_key_covers_whole_blocks_only():
    # 12 characters = one whole block: the last 4 do not count.
    assert KEYER.key(_req(prompt="abcdefgh1234")) == KEYER.key(_req(prompt="abcdefgh5678"))
    # Beyond prefix_blocks nothing counts.
    assert KEYER.key(_req(prompt="a" * 16 + "X")) == KEYER.key(_req(prompt="a" * 16 + "Y" * 50))


def test_token_id_prompts_key_on_their_leading_ids():
    assert KEYER.key(_req(prompt_token_ids=list(range(8)) + [99])) == \
        KEYER.key(_req(prompt_token_ids=list(range(8)) + [7, 7, 7]))
    assert KEYER.key(_req(prompt_token_ids=list(range(8)))) != \
        KEYER.key(_req(prompt_token_ids=[1] + list(range(1, 8))))


def test_chat_keys_on_the_messages_text_not_the_json():
    system = {"role": "system", "content": "You answer questions about the handbook."}
    one = [system, {"role": "user", "content": "first question"}]
    two = [system, {"role": "user", "content": "a different question"}]
    assert KEYER.key(_req(messages=one)) == KEYER.key(_req(messages=two))
    # Same text in a key of another order (dict order is the client's): same key.
    reordered = [{"content": system["content"], "role": "system"}, one[1]]
    assert KEYER.key(_req(messages=reordered)) == KEYER.key(_req(messages=one))
    # A text prompt with the same characters is not a chat: another key.
    assert KEYER.key(_req(prompt=chat_text(one))) != KEYER.key(_req(messages=one))
    # The role counts, as the template renders it.
    assert KEYER.key(_req(messages=[{"role": "user", "content": system["content"]}])) != \
        KEYER.key(_req(messages=[system]))


def test_keyer_knobs_must_be_positive():
    with pytest.raises(ValueError, match="block_tokens"):
        PrefixKeyer(block_tokens=0)


# Rendezvous --------------------------------------------------------------------------------

def test_two_router_instances_agree_on_every_key():
    """Two policies (two router replicas) with the candidates in different orders choose the
    same replica for every key: nothing but the key and the replica ids decides."""
    ids = [f"replica-{i}" for i in range(5)]
    one, two = _policy(), build_policy("prefix_affinity", block_tokens=4, prefix_blocks=2,
                                       chars_per_token=2)
    shuffled = ids[:]
    random.Random(7).shuffle(shuffled)
    for n in range(200):
        key = one.key(_req(prompt=f"tenant prefix number {n:04d} and then a question"))
        assert one.choose(key, _idle(*ids)).ranked == two.choose(key, _idle(*shuffled)).ranked


def test_keys_spread_over_replicas():
    ids = ["a", "b", "c", "d"]
    firsts = [rendezvous_order(n.to_bytes(4, "big"), ids)[0] for n in range(2000)]
    for rid in ids:
        assert 400 < firsts.count(rid) < 600, (rid, firsts.count(rid))


def test_a_removed_replica_moves_only_its_own_keys():
    ids = ["a", "b", "c", "d"]
    keys = [n.to_bytes(4, "big") for n in range(2000)]
    before = {k: rendezvous_order(k, ids)[0] for k in keys}
    after = {k: rendezvous_order(k, ["a", "b", "d"])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "c" for k in moved)
    # An added replica takes keys only for itself.
    grown = {k: rendezvous_order(k, ids + ["e"])[0] for k in keys}
    assert all(grown[k] in (before[k], "e") for k in keys)


# Choice ------------------------------------------------------------------------------------

def test_affinity_keeps_a_key_on_its_replica_and_ranks_the_rest():
    p = _policy()
    key = p.key(_req(prompt="a tenant's long shared system prompt"))
    choice = p.choose(key, _idle("a", "b", "c"))
    assert choice.reason == "affinity"
    assert sorted(choice.ranked) == ["a", "b", "c"]
    assert choice.ranked == tuple(rendezvous_order(key, ["a", "b", "c"]))  # type: ignore[arg-type]


def test_load_fallback_past_the_margin_at_small_loads():
    p = _policy(margin=4)
    key = p.key(_req(prompt="a tenant's long shared system prompt"))
    best, other = rendezvous_order(key, ["a", "b"])  # type: ignore[arg-type]
    # 6 + 1 of 9 is past 1.25 x the mean (5.6), but 6 is within the margin over the other's 2.
    at_margin = p.choose(key, [Candidate(best, 6), Candidate(other, 2)])
    assert (at_margin.reason, at_margin.ranked[0]) == ("affinity", best)
    past = p.choose(key, [Candidate(best, 7), Candidate(other, 2)])
    assert past.reason == "load_fallback"
    assert past.ranked == (other, best)  # the busy replica stays a last resort


def test_load_fallback_past_the_load_factor_at_large_loads():
    p = _policy(margin=4, factor=1.25)
    key = p.key(_req(prompt="a tenant's long shared system prompt"))
    best, other = rendezvous_order(key, ["a", "b"])  # type: ignore[arg-type]
    # 33 requests with this one: 1.25 x the mean is 20.6, so the key's replica takes it at 19
    # (19 + 1 <= 20.6) and not at 20 (21 > 20.6; 20 is past 12 + the margin of 4 too).
    assert p.choose(key, [Candidate(best, 19), Candidate(other, 13)]).reason == "affinity"
    past = p.choose(key, [Candidate(best, 20), Candidate(other, 12)])
    assert (past.reason, past.ranked[0]) == ("load_fallback", other)


def test_a_few_requests_of_imbalance_at_high_load_keep_affinity_regression_margin_only_bound():
    """On the H200 (two replicas, 32 streams, 64 prefixes) the keys' split was a few requests
    uneven at any moment; the margin alone (4) then sent the key's requests to the other
    replica, which cached the same prefixes again (hit rate 0.46 where routing by prefix alone
    reached 0.94). 19 + 1 against 14 is 1.18 x the mean: affinity."""
    p = _policy(margin=4)
    key = p.key(_req(prompt="a tenant's long shared system prompt"))
    best, other = rendezvous_order(key, ["a", "b"])  # type: ignore[arg-type]
    assert p.choose(key, [Candidate(best, 19), Candidate(other, 14)]).reason == "affinity"
    assert p.choose(key, [Candidate(best, 24), Candidate(other, 18)]).reason == "affinity"


def test_load_fallback_follows_the_keys_own_order_within_the_bound():
    """With three replicas the spill goes to the key's second choice when that one is within
    the bound (every router spills a hot prefix to the same place), not just anywhere."""
    p = _policy(margin=2, factor=1.25)
    key = p.key(_req(prompt="a tenant's long shared system prompt"))
    first, second, third = rendezvous_order(key, ["a", "b", "c"])  # type: ignore[arg-type]
    # 5 + 1 is within 1.25 x the mean (6.25 of 15 with this one); 6 + 1 is not (6.67 of 16).
    loads = [Candidate(first, 9), Candidate(second, 5), Candidate(third, 0)]
    assert p.choose(key, loads).ranked[0] == second
    loads = [Candidate(first, 9), Candidate(second, 6), Candidate(third, 0)]
    assert p.choose(key, loads).ranked[0] == third


def test_load_factor_must_be_at_least_one():
    with pytest.raises(ValueError, match="load_factor"):
        _policy(factor=0.9)


def test_unknown_loads_do_not_trigger_a_fallback():
    p = _policy(margin=0)
    key = p.key(_req(prompt="a tenant's long shared system prompt"))
    best, other = rendezvous_order(key, ["a", "b"])  # type: ignore[arg-type]
    assert p.choose(key, [Candidate(best, None), Candidate(other, 0)]).reason == "affinity"
    assert p.choose(key, [Candidate(best, 5), Candidate(other, None)]).reason == "affinity"


def test_a_request_without_a_key_is_spread_cold():
    p = _policy()
    choice = p.choose(p.key(_req(prompt="hi")), _idle("a", "b"))
    assert choice.reason == "cold" and choice.ranked == ()


def test_power_of_two_never_keys():
    p = build_policy("power_of_two")
    assert p.key(_req(prompt="a tenant's long shared system prompt")) is None
    assert p.choose(None, _idle("a", "b")).reason == "power_of_two"


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match="power_of_two, prefix_affinity"):
        build_policy("round_robin")
