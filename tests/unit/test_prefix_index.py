"""The prefix_cache policy's pure parts: block hashes, the replica's record of what it served,
the router's index built from the records' reports, and the choice."""

from __future__ import annotations

import hashlib
import random

import pytest

from serve_app.engine.protocol import EngineLoad, GenerationRequest, SamplingOptions
from serve_app.engine.server import ServedBlocks
from serve_app.routing import POLICIES, build_policy
from serve_app.routing.adapter_placement import AdapterPlacement
from serve_app.routing.policy import Candidate
from serve_app.routing.prefix_blocks import BlockHasher, PromptBlocks
from serve_app.routing.prefix_cache import PrefixCache
from serve_app.routing.prefix_index import PrefixIndex
from serve_app.routing.prefix_key import chat_text

HASHER = BlockHasher(block_tokens=4, chars_per_token=2, max_blocks=64)  # blocks of 8 chars
SYSTEM = {"role": "system", "content": "You answer questions about the handbook. " * 4}


def _req(salt: str | None = "tenant-a", session: str | None = None,
         **prompt: object) -> GenerationRequest:
    return GenerationRequest("r", SamplingOptions(), cache_salt=salt, session=session,
                             **prompt)  # type: ignore[arg-type]


def _session(turns: int, name: str = "s1") -> list[list[dict[str, str]]]:
    """A conversation's requests: turn k sends the system prompt and every earlier turn."""
    history = [SYSTEM]
    out = []
    for k in range(turns):
        history = history + [{"role": "user", "content": f"{name} question {k}: " + "why? " * 6}]
        out.append(list(history))
        history = history + [{"role": "assistant", "content": f"{name} answer {k} " * 5}]
    return out


# Block hashes ------------------------------------------------------------------------------

def _reference(salt: str, kind: bytes, blocks: list[bytes]) -> tuple[int, ...]:
    """The chain written out: block i's hash covers the salt and blocks 0..i."""
    root = hashlib.blake2b(len(salt.encode()).to_bytes(4, "little") + salt.encode(),
                           digest_size=8).digest()
    parent, out = root + kind, []
    for b in blocks:
        parent = hashlib.blake2b(parent + b, digest_size=8).digest()
        out.append(int.from_bytes(parent, "big"))
    return tuple(out)


def test_chat_blocks_are_the_chained_hashes_of_the_messages_text():
    messages = _session(3)[-1]
    text = chat_text(messages)
    cut = [text[i:i + 8].encode() for i in range(0, len(text) // 8 * 8, 8)]
    assert HASHER.of(_req(messages=messages)).blocks == _reference("tenant-a", b"c", cut)


def test_a_later_turn_extends_the_earlier_turns_blocks():
    turns = _session(4)
    blocks = [HASHER.of(_req(messages=m)).blocks for m in turns]
    for earlier, later in zip(blocks, blocks[1:]):
        assert len(later) > len(earlier)
        # Every whole block of turn k's text is a block of turn k+1's (a text's last partial
        # block is not hashed).
        assert later[:len(earlier)] == earlier


def test_salt_separates_tenants_and_sessions_are_scoped_by_tenant():
    a = HASHER.of(_req("tenant-a", session="chat-1", prompt="the same long prompt text"))
    b = HASHER.of(_req("tenant-b", session="chat-1", prompt="the same long prompt text"))
    assert a.blocks and not set(a.blocks) & set(b.blocks)
    assert a.session is not None and b.session is not None and a.session != b.session
    assert HASHER.of(_req("tenant-a", prompt="the same long prompt text")).session is None
    # The salt's length is hashed: a salt that runs into the prompt is another chain.
    assert HASHER.of(_req("ab", prompt="c" * 16)).blocks != \
        HASHER.of(_req("a", prompt="bc" + "c" * 14)).blocks


def test_text_token_and_chat_prompts_hash_apart_and_short_prompts_have_no_blocks():
    text = "x" * 32
    assert HASHER.of(_req(prompt=text)).blocks != HASHER.of(
        _req(messages=[{"role": "", "content": text}])).blocks
    assert len(HASHER.of(_req(prompt_token_ids=list(range(9)))).blocks) == 2
    assert HASHER.of(_req(prompt="short")).blocks == ()
    assert HASHER.of(_req(prompt_token_ids=[1, 2, 3])).blocks == ()


def test_hashing_stops_at_max_blocks_whatever_the_body():
    huge = "y" * 1_000_000
    assert len(HASHER.of(_req(prompt=huge)).blocks) == HASHER.max_blocks
    many = [{"role": "user", "content": "z" * 3} for _ in range(100_000)]
    assert len(HASHER.of(_req(messages=many)).blocks) == HASHER.max_blocks
    assert len(HASHER.of(_req(prompt_token_ids=[7] * 100_000)).blocks) == HASHER.max_blocks


def test_messages_split_anywhere_hash_like_their_joined_text():
    rng = random.Random(3)
    for _ in range(50):
        pieces = [{"role": rng.choice(["user", "assistant"]),
                   "content": "w" * rng.randrange(0, 30)} for _ in range(rng.randrange(1, 8))]
        text = chat_text(pieces)
        cut = [text[i:i + 8].encode() for i in range(0, len(text) // 8 * 8, 8)]
        assert HASHER.of(_req(messages=pieces)).blocks == _reference("tenant-a", b"c", cut)


# The replica's record --------------------------------------------------------------------

def test_the_record_is_bounded_and_evicts_a_requests_tail_before_its_head():
    served = ServedBlocks(capacity=6)
    served.record((1, 2, 3, 4))
    served.record((10, 11, 12, 13))
    assert len(served) == 6
    # The older request lost its tail blocks first: its prefix (1, 2) is still held.
    assert 1 in served and 2 in served and 3 not in served and 4 not in served
    served.record((1, 2, 3))  # touched again: 1 and 2 are the most recent now
    assert all(h in served for h in (1, 2, 3))


def test_reports_are_changes_since_what_the_router_holds():
    served = ServedBlocks(capacity=4)
    full = served.report(None)
    assert full.base is None and full.added == ()
    served.record((1, 2, 3))
    delta = served.report((served.epoch, full.seq))
    assert (delta.base, set(delta.added), delta.removed) == (0, {1, 2, 3}, ())
    served.record((5, 6))  # over capacity by one: evicts 3, the first request's tail
    later = served.report((served.epoch, delta.seq))
    assert set(later.added) == {5, 6} and later.removed == (3,)
    # Another epoch (the replica restarted), or a state older than the log: the whole record.
    assert served.report(("old-epoch", 3)).base is None
    for i in range(20):
        served.record((100 + i,))
    assert served.report((served.epoch, later.seq)).base is None


# The router's index ----------------------------------------------------------------------

def _feed(index: PrefixIndex, records: dict[str, ServedBlocks],
          loads: dict[str, int] | None = None) -> None:
    """One engine-feed poll: every replica answers with its load (``loads``, default 0) and its
    report since what the index holds."""
    known = index.known()
    index.apply([EngineLoad((loads or {}).get(rid, 0), 0, replica=rid,
                            prefix_report=r.report(known.get(rid)))
                 for rid, r in records.items()])


def test_the_index_follows_the_records_and_two_indexes_agree():
    records = {"a": ServedBlocks(100), "b": ServedBlocks(100)}
    one, two = PrefixIndex(), PrefixIndex()
    records["a"].record((1, 2, 3))
    _feed(one, records)
    records["b"].record((1, 9))
    records["a"].record((4,))
    _feed(one, records)
    _feed(two, records)  # a router that starts late gets whole records
    for index in (one, two):
        assert index.blocks_of("a") == {1, 2, 3, 4} and index.blocks_of("b") == {1, 9}
    assert one.matched((1, 2, 3, 7), ["a", "b"]) == {"a": 3, "b": 1}
    assert one.matched((9,), ["a", "b", "c"]) == {"a": 0, "b": 1, "c": 0}
    assert one.matched((7, 1), ["a", "b"]) == {"a": 0, "b": 0}  # chained: no first, no match


def test_a_stale_report_is_ignored_and_the_next_poll_catches_up():
    served = ServedBlocks(100)
    index = PrefixIndex()
    served.record((1,))
    _feed(index, {"a": served})
    old = served.report(index.known()["a"])
    served.record((2,))
    _feed(index, {"a": served})
    assert not index.take("a", old)  # a late answer stood in again: already applied
    assert index.blocks_of("a") == {1, 2}


def test_a_replica_that_leaves_takes_only_its_own_entries():
    records = {rid: ServedBlocks(100) for rid in "abc"}
    for n, rid in enumerate("abc"):
        records[rid].record((n, 100 + n))
    index = PrefixIndex()
    _feed(index, records)
    before = {rid: set(index.blocks_of(rid)) for rid in "ac"}
    del records["b"]
    _feed(index, records)
    assert sorted(index.replicas()) == ["a", "c"]
    assert {rid: index.blocks_of(rid) for rid in "ac"} == before


# The choice -------------------------------------------------------------------------------

def _policy(index: PrefixIndex, cost: int = 4, margin: int = 4) -> PrefixCache:
    return PrefixCache(HASHER, lambda: index, imbalance_margin=margin, load_factor=1.25,
                       request_cost_tokens=cost)


def _serve(policy: PrefixCache, index: PrefixIndex, records: dict[str, ServedBlocks],
           request: GenerationRequest, loads: dict[str, int]) -> tuple[str, str]:
    """The feed reports ``loads``; route ``request``, record it on the replica chosen, let the
    feed poll again; the replica and the reason. (Serve's queue lengths are left unknown: the
    policy reads the feed's.)"""
    _feed(index, records, loads)
    choice = policy.choose(policy.key(request), [Candidate(r, None) for r in loads])
    rid = choice.ranked[0]
    records[rid].record(request.prefix_hashes or ())
    _feed(index, records, loads)
    return rid, choice.reason


def test_a_conversations_turns_follow_its_history():
    index, records = PrefixIndex(), {"a": ServedBlocks(10_000), "b": ServedBlocks(10_000)}
    policy = _policy(index)
    # The system prompt is cached on both (popular), so history decides.
    for rid in records:
        records[rid].record(HASHER.of(_req(messages=[SYSTEM])).blocks)
    _feed(index, records)
    served = [_serve(policy, index, records, _req(messages=m), {"a": 3, "b": 3})
              for m in _session(6)]
    assert len({rid for rid, _ in served}) == 1, served
    assert [reason for _, reason in served[1:]] == ["affinity"] * 5


def test_new_sessions_sharing_a_system_prompt_spread_by_load():
    index, records = PrefixIndex(), {"a": ServedBlocks(10_000), "b": ServedBlocks(10_000)}
    system_blocks = len(HASHER.of(_req(messages=[SYSTEM])).blocks)
    # One request of load is worth half the system prompt's prefill (in tokens).
    policy = _policy(index, cost=system_blocks * HASHER.block_tokens // 2)
    first = _req(messages=_session(1, "s1")[0])
    home, _ = _serve(policy, index, records, first, {"a": 0, "b": 0})
    other = "b" if home == "a" else "a"
    # The second session matches only the system prompt on the first's replica, which is
    # busier by more than that prefill is worth.
    second = _req(messages=_session(1, "s2")[0])
    rid, reason = _serve(policy, index, records, second, {home: 4, other: 0})
    assert (rid, reason) == (other, "load_fallback")
    # Both cache the system prompt now: equal matches go by load.
    third = _req(messages=_session(1, "s3")[0])
    assert _serve(policy, index, records, third, {home: 0, other: 2})[0] == home


def test_a_prompt_cached_nowhere_goes_to_the_least_loaded_the_same_on_every_router():
    index = PrefixIndex()
    policy, again = _policy(index), _policy(index)
    request = _req(prompt="an unseen prompt of a few blocks")
    cands = [Candidate("a", 5), Candidate("b", 2), Candidate("c", 2)]
    choice = policy.choose(policy.key(request), cands)
    assert choice.reason == "spread" and choice.ranked[0] in ("b", "c")
    assert again.choose(again.key(_req(prompt="an unseen prompt of a few blocks")),
                        cands[::-1]).ranked == choice.ranked


def test_the_load_bound_overrides_any_match():
    index, records = PrefixIndex(), {"a": ServedBlocks(10_000), "b": ServedBlocks(10_000)}
    records["a"].record(HASHER.of(_req(prompt="p" * 400)).blocks)
    _feed(index, records)
    policy = _policy(index, cost=0)  # only the bound keeps it off its replica
    key = policy.key(_req(prompt="p" * 400 + "?"))
    cands = [Candidate("a", None), Candidate("b", None)]
    _feed(index, records, {"a": 6, "b": 2})
    assert policy.choose(key, cands).ranked[0] == "a"
    _feed(index, records, {"a": 7, "b": 2})
    past = policy.choose(key, cands)
    assert (past.reason, past.ranked) == ("load_fallback", ("b", "a"))
    # Requests this router sent count in a replica's load until the next view.
    _feed(index, records, {"a": 0, "b": 0})
    index.routed("a")
    index.routed("a")
    assert index.load("a") == 2 and index.load("c") is None


def test_a_session_key_keeps_a_session_together_over_a_longer_prompt_match():
    index, records = PrefixIndex(), {"a": ServedBlocks(10_000), "b": ServedBlocks(10_000)}
    policy = _policy(index)
    records["b"].record(HASHER.of(_req(prompt="q" * 200)).blocks)
    _feed(index, records)
    first = _req(session="chat-7", prompt="q" * 40)
    rid, _ = _serve(policy, index, records, first, {"a": 0, "b": 5})
    assert rid == "a"
    # The same session's next request matches more on b, but the session lives on a.
    nxt = _req(session="chat-7", prompt="q" * 200)
    assert _serve(policy, index, records, nxt, {"a": 0, "b": 0})[0] == "a"
    # Another tenant's same session name is not that session.
    other = _req("tenant-b", session="chat-7", prompt="q" * 40)
    assert policy.key(other).session != policy.key(_req(session="chat-7", prompt="q" * 40)).session


def test_keys_are_computed_once_and_carried_to_the_replica():
    policy = _policy(PrefixIndex())
    request = _req(session="s", prompt="k" * 50)
    key = policy.key(request)
    assert isinstance(key, PromptBlocks) and request.prefix_block_tokens == HASHER.block_tokens
    assert request.prefix_hashes == (key.session, *key.blocks)
    assert policy.key(request) == key  # a second attempt reads them back
    assert policy.key(_req(prompt="hi")) is None and policy.key(None) is None
    assert policy.choose(None, [Candidate("a", 0)]).reason == "cold"


def test_the_registry_builds_every_policy_by_name():
    assert POLICIES == ("power_of_two", "prefix_affinity", "prefix_cache")
    policy = build_policy("prefix_cache", "m", block_tokens=8)
    assert isinstance(policy, AdapterPlacement) and isinstance(policy.inner, PrefixCache)
    with pytest.raises(ValueError, match="prefix_cache"):
        build_policy("round_robin")


def test_a_turn_stays_with_its_history_while_its_replica_still_counts_the_last_turn():
    """One request of load more (the previous turn, still counted as it closes) does not move
    a conversation whose history is worth less than a request of prefill."""
    index, records = PrefixIndex(), {"a": ServedBlocks(10_000), "b": ServedBlocks(10_000)}
    for rid in records:  # the system prompt is cached everywhere
        records[rid].record(HASHER.of(_req(messages=[SYSTEM])).blocks)
    _feed(index, records)
    policy = _policy(index, cost=256)  # a request is worth 64 blocks, more than two turns
    turns = _session(2)
    home, _ = _serve(policy, index, records, _req(messages=turns[0]), {"a": 0, "b": 0})
    other = "b" if home == "a" else "a"
    assert _serve(policy, index, records, _req(messages=turns[1]), {home: 1, other: 0}) == \
        (home, "affinity")
    # Two more than the least-loaded: the history is not worth the queue.
    turn3 = _req(messages=_session(3)[2])
    assert _serve(policy, index, records, turn3, {home: 2, other: 0})[0] == other


def test_the_replica_predicts_its_cached_prefix_and_counts_the_error():
    """LLMServer._record returns the prompt tokens its record held already (leading blocks, the
    session hash aside); RecordError compares that with the engine's cached tokens."""
    from types import SimpleNamespace

    from serve_app.engine.server import LLMServer, RecordError

    server = SimpleNamespace(served=None, engine=object())  # only the record is used
    policy = _policy(PrefixIndex())
    first = _req(session="k", prompt="a" * 40)  # 5 blocks of 8 characters
    policy.key(first)
    assert LLMServer._record(server, first) == 0  # type: ignore[arg-type]
    again = _req(session="k", prompt="a" * 40 + "b" * 16)
    policy.key(again)
    assert LLMServer._record(server, again) == 5 * HASHER.block_tokens  # type: ignore[arg-type]
    err = RecordError()
    err.add(20, 16.0, 30)
    err.add(50, None, 60)  # an engine that does not say: not counted
    err.add(10, 14.0, 8)  # the prediction is capped at the prompt
    assert err.as_dict() == {"requests": 2.0, "prompt_tokens": 38.0, "predicted_tokens": 28.0,
                             "cached_tokens": 30.0, "abs_error_tokens": 10.0,
                             "over_tokens": 4.0}


def test_the_request_router_uses_the_models_index_and_counts_what_it_chose():
    """Through Serve's request router: prefix_cache reads the index of the router's model (the
    one its engine feed writes), writes the hashes into the request, and the router counts
    each request in its replica's load when it chooses, once (a retry of the same request
    and Serve's on_request_routed add nothing), until the next view."""
    import asyncio
    from types import SimpleNamespace

    from serve_app.routing.pinned import TARGET_KWARG, PinnedOrPolicyRouter
    from serve_app.routing.prefix_index import index_for

    router = PinnedOrPolicyRouter.__new__(PinnedOrPolicyRouter)
    router.initialize_state(policy="prefix_cache", model="unit-model", block_tokens=4,
                            chars_per_token=2)
    router.decisions = SimpleNamespace(record=lambda reason: None)
    index, records = index_for("unit-model"), {"a": ServedBlocks(100), "b": ServedBlocks(100)}
    request = _req(prompt="a prompt that b has cached already")
    records["b"].record(HASHER.of(request).blocks)
    _feed(index, records)
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=r)) for r in "ab"]
    pending = SimpleNamespace(args=[request], kwargs={},
                              routing_context=SimpleNamespace(should_backoff=False))
    ranked = asyncio.run(router.choose_replicas(replicas, pending))
    assert [r[0].replica_id.unique_id for r in ranked] == ["b", "a"]
    assert request.prefix_hashes == HASHER.of(request).blocks
    assert (index.load("b"), index.load("a")) == (1, 0)
    asyncio.run(router.choose_replicas(replicas, pending))  # Serve asks again (a backoff)
    router.on_request_routed(pending, replicas[1].replica_id, None)
    router.on_request_routed(SimpleNamespace(args=[], kwargs={TARGET_KWARG: "a"}),
                             replicas[0].replica_id, None)  # a pinned call: not a request
    assert (index.load("b"), index.load("a")) == (1, 0)


def test_requests_chosen_before_any_is_routed_see_each_other_regression_a_burst_on_one_replica():
    """New sessions on a system prompt both replicas cache tie on the match, so the load
    decides. Decisions taken before Serve has routed the earlier ones (a burst: Serve's
    on_request_routed comes a round trip later) saw the same loads and all went to the
    replica the tie-break names; each choice counts at once, so the burst alternates."""
    import asyncio
    from types import SimpleNamespace

    from serve_app.routing.pinned import PinnedOrPolicyRouter
    from serve_app.routing.prefix_index import index_for

    router = PinnedOrPolicyRouter.__new__(PinnedOrPolicyRouter)
    router.initialize_state(policy="prefix_cache", model="unit-burst", block_tokens=4,
                            chars_per_token=2)
    router.decisions = SimpleNamespace(record=lambda reason: None)
    index, records = index_for("unit-burst"), {"a": ServedBlocks(100), "b": ServedBlocks(100)}
    system = "a system prompt every replica has cached "
    for record in records.values():
        record.record(HASHER.of(_req(prompt=system)).blocks)
    _feed(index, records)
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=r)) for r in "ab"]
    chosen = []
    for i in range(6):  # none routed yet
        pending = SimpleNamespace(args=[_req(prompt=f"{system}question {i}")], kwargs={},
                                  routing_context=SimpleNamespace(should_backoff=False))
        ranked = asyncio.run(router.choose_replicas(replicas, pending))
        chosen.append(ranked[0][0].replica_id.unique_id)
    assert sorted(chosen) == ["a", "a", "a", "b", "b", "b"], chosen
