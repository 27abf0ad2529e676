"""Adapter affinity: a LoRA adapter's requests go to the same replica from every router (the
first of the adapter's rendezvous order within the load bound), whichever tenant sends them
and whatever their prompt; the prefix_cache policy's hashes cover the adapter as vLLM's do."""

from serve_app.engine.protocol import GenerationRequest, SamplingOptions
from serve_app.routing.policy import Candidate
from serve_app.routing.prefix_affinity import PrefixAffinity
from serve_app.routing.prefix_blocks import BlockHasher
from serve_app.routing.prefix_key import PrefixKeyer

REPLICAS = [f"replica-{i}" for i in range(4)]


def _request(salt, prompt, adapter=None):
    return GenerationRequest("r", SamplingOptions(), prompt=prompt, cache_salt=salt,
                             adapter=(adapter, 7, f"/adapters/{adapter}") if adapter else None)


def _policy():
    return PrefixAffinity(PrefixKeyer(block_tokens=4, prefix_blocks=2, chars_per_token=1))


def _first(policy, request, loads=None):
    key = policy.key(request)
    candidates = [Candidate(r, (loads or {}).get(r, 0)) for r in REPLICAS]
    return policy.choose(key, candidates)


def test_an_adapters_requests_go_to_one_replica_whoever_sends_them():
    policy = _policy()
    choices = {_first(policy, _request(salt, prompt, "tune")).ranked[0]
               for salt in ("tenant-a", "tenant-b")
               for prompt in ("hi", "a long prompt of many blocks", "another one entirely")}
    assert len(choices) == 1
    assert _first(policy, _request("tenant-a", "hi", "tune")).reason == "affinity"
    # A short prompt without an adapter has nothing to keep together: spread by load.
    assert _first(policy, _request("tenant-a", "hi")).reason == "cold"


def test_adapters_spread_over_the_replicas():
    policy = _policy()
    homes = {_first(policy, _request("t", "hi", f"tune-{i}")).ranked[0] for i in range(16)}
    assert len(homes) >= 3  # rendezvous hashing: not every adapter on one replica


def test_an_adapters_overflow_spills_to_its_next_replica():
    policy = _policy()
    first = _first(policy, _request("t", "hi", "tune"))
    home, second = first.ranked[0], first.ranked[1]
    busy = _first(policy, _request("t", "hi", "tune"), loads={home: 20})
    assert busy.reason == "load_fallback" and busy.ranked[0] == second


def test_prefix_cache_hashes_cover_the_adapter():
    hasher = BlockHasher(block_tokens=4, chars_per_token=1, max_blocks=8)
    prompt = "the same long prompt"
    base = hasher.of(_request("t", prompt))
    one, two = hasher.of(_request("t", prompt, "one")), hasher.of(_request("t", prompt, "two"))
    assert base.blocks and one.blocks and two.blocks
    assert not set(base.blocks) & set(one.blocks) and not set(one.blocks) & set(two.blocks)
    assert hasher.of(_request("t", prompt, "one")).blocks == one.blocks
