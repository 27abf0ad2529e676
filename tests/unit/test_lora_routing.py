"""Adapter affinity: a LoRA adapter's requests go to the same replica from every router (the
first of the adapter's rendezvous order within the load bound), whichever tenant sends them
and whatever their prompt; the prefix_cache policy's hashes cover the adapter as vLLM's do.
Adapter placement (serve_app/routing/adapter_placement.py): they go where the replicas report
the adapter loaded, on at most K replicas, grown past the load bound, shrunk when idle."""

from serve_app.engine.protocol import EngineLoad, GenerationRequest, SamplingOptions
from serve_app.routing.adapter_placement import AdapterPlacement
from serve_app.routing.policy import Candidate
from serve_app.routing.prefix_affinity import PrefixAffinity
from serve_app.routing.prefix_blocks import BlockHasher
from serve_app.routing.prefix_index import PrefixIndex
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


# Adapter placement: follow where the replicas report the adapter loaded --------------------


def _placement(k=2):
    index = PrefixIndex()
    return AdapterPlacement(_policy(), lambda: index, adapter_replicas=k), index


def _view(index, loads, holding):
    """One engine-feed view: each replica's load and the adapters it reports loaded."""
    index.apply([EngineLoad(running=loads.get(r, 0), waiting=0, replica=r,
                            adapters=tuple(holding.get(r, ()))) for r in REPLICAS])


def _pick(policy, adapter="tune", salt="t", prompt="hi"):
    return policy.choose(policy.key(_request(salt, prompt, adapter)),
                         [Candidate(r, None) for r in REPLICAS])


def test_a_replica_that_reports_the_adapter_loaded_gets_its_requests():
    policy, index = _placement()
    _view(index, {}, {})
    cold = _pick(policy)  # nobody holds it: the first of its rendezvous order loads it
    assert cold.reason == "affinity"
    elsewhere = next(r for r in REPLICAS if r != cold.ranked[0])
    _view(index, {}, {elsewhere: ("other", "tune")})
    for salt, prompt in (("a", "hi"), ("b", "a long prompt of many blocks")):
        choice = _pick(policy, salt=salt, prompt=prompt)
        assert (choice.reason, choice.ranked[0]) == ("affinity", elsewhere)
    assert sorted(choice.ranked) == sorted(REPLICAS)  # the rest still ranked (refusals)


def test_over_its_bound_the_adapter_spills_to_a_second_replica_which_then_holds_it():
    policy, index = _placement(k=2)
    home = REPLICAS[2]
    _view(index, {home: 20}, {home: ("tune",)})
    spill = _pick(policy)
    second = spill.ranked[0]
    assert spill.reason == "load_fallback" and second != home
    # The second reports it loaded: it is a holder now, and still gets the overflow.
    _view(index, {home: 20}, {home: ("tune",), second: ("tune",)})
    again = _pick(policy)
    assert (again.reason, again.ranked[0]) == ("affinity", second)


def test_an_adapter_sits_on_at_most_k_replicas():
    policy, index = _placement(k=2)
    holders = REPLICAS[:2]
    _view(index, {r: 20 for r in holders}, {r: ("tune",) for r in holders})
    full = _pick(policy)  # both holders over the bound, K reached: wait on a holder
    assert full.reason == "affinity" and full.ranked[0] in holders
    # Three report it (earlier traffic): only K of them are sent its requests.
    _view(index, {r: 20 for r in REPLICAS[:3]}, {r: ("tune",) for r in REPLICAS[:3]})
    order = _pick(policy).ranked
    served = {_pick(policy, salt=s).ranked[0] for s in "abcdef"}
    assert len(served) == 1 and served <= set(order[:2])
    one, one_index = _placement(k=1)
    _view(one_index, {REPLICAS[0]: 20}, {REPLICAS[0]: ("tune",)})
    assert _pick(one).ranked[0] == REPLICAS[0]  # K=1: never a second replica


def test_when_the_adapter_goes_idle_its_requests_shrink_back_to_one_replica():
    policy, index = _placement(k=2)
    _view(index, {}, {r: ("tune",) for r in REPLICAS[:2]})
    # Under the bound every request goes to one holder: the other's LRU then drops the
    # adapter (it reports it no longer), and it is no holder any more.
    homes = {_pick(policy, salt=s, prompt=p).ranked[0] for s in "abc" for p in ("x", "y")}
    assert len(homes) == 1
    home = homes.pop()
    # Busier than the other holder but within the bound: still the one (not spread to both).
    _view(index, {home: 3}, {r: ("tune",) for r in REPLICAS[:2]})
    assert {_pick(policy, salt=s).ranked[0] for s in "abc"} == {home}
    _view(index, {}, {home: ("tune",)})
    assert {_pick(policy, salt=s).ranked[0] for s in "abc"} == {home}


def test_requests_without_an_adapter_are_routed_by_the_prefix_policy():
    policy, index = _placement()
    _view(index, {REPLICAS[0]: 3}, {r: ("tune",) for r in REPLICAS})
    inner = _policy()
    for prompt in ("hi", "a long prompt of many blocks", "another one entirely, longer"):
        request = _request("t", prompt)
        loads = [Candidate(r, i) for i, r in enumerate(REPLICAS)]
        assert policy.choose(policy.key(request), loads) == inner.choose(inner.key(request),
                                                                         loads)


def test_two_routers_that_read_the_same_view_place_alike():
    (one, one_index), (two, two_index) = _placement(), _placement()
    for index in (one_index, two_index):
        _view(index, {REPLICAS[1]: 20}, {REPLICAS[1]: ("tune",)})
    assert all(_pick(one, adapter=f"a{i}") == _pick(two, adapter=f"a{i}") for i in range(8))
    assert _pick(one) == _pick(two)


def test_serves_queue_lengths_count_a_burst_the_feed_has_not_seen_yet():
    """Between two polls the feed still reports the adapter's replica idle; Serve's queue
    length (this router's own sends) puts it past the bound: the overflow still spills."""
    policy, index = _placement()
    home = REPLICAS[0]
    _view(index, {}, {home: ("tune",)})
    key = policy.key(_request("t", "hi", "tune"))
    busy = policy.choose(key, [Candidate(r, 9 if r == home else 0) for r in REPLICAS])
    assert busy.reason == "load_fallback" and busy.ranked[0] != home


def test_a_burst_grows_an_adapter_onto_k_replicas_before_the_feed_reports_the_second():
    """Regression: growth was decided by the holders the feed reported, so within a burst the
    replica that began loading the adapter (not yet reported) counted as no holder, and once it
    too was past the bound a third replica was grown: K was exceeded until the next poll."""
    policy, index = _placement(k=2)
    home = REPLICAS[0]
    _view(index, {}, {home: ("tune",)})  # the feed: only home holds it, all idle
    key = policy.key(_request("t", "hi", "tune"))
    second = policy.choose(key, [Candidate(r, 9 if r == home else 0) for r in REPLICAS])
    assert second.reason == "load_fallback"
    grown = second.ranked[0]
    # This router's own sends put home and the growing second past the bound.
    choice = policy.choose(key, [Candidate(r, 9 if r in (home, grown) else 0) for r in REPLICAS])
    assert choice.ranked[0] in (home, grown), choice  # the least loaded of the two, not a third


def test_under_power_of_two_an_adapters_requests_are_still_placed():
    """The default policy spreads the base model's requests by Serve's choice (no key, so the
    router fetches no load for them) while an adapter's go where the replicas hold it, read
    against Serve's queue lengths (the router fetches them for an adapter's key)."""
    from serve_app.routing import build_policy
    from serve_app.routing.power_of_two import PowerOfTwo

    index = PrefixIndex()
    policy = AdapterPlacement(PowerOfTwo(), lambda: index)
    home = REPLICAS[3]
    _view(index, {}, {home: ("tune",)})
    key = policy.key(_request("t", "a long prompt of many blocks", "tune"))
    assert policy.needs_load(key)
    placed = policy.choose(key, [Candidate(r, 0) for r in REPLICAS])
    assert (placed.reason, placed.ranked[0]) == ("affinity", home)
    busy = policy.choose(key, [Candidate(r, 9 if r == home else 0) for r in REPLICAS])
    assert busy.reason == "load_fallback" and busy.ranked[0] != home
    base = policy.key(_request("t", "a long prompt of many blocks"))
    assert base is None  # no key: no load fetched, Serve's power of two spreads it
    assert policy.choose(base, [Candidate(r, None) for r in REPLICAS]).ranked == ()
    # The registry wraps the default this way; adapter_replicas 0 leaves it bare.
    assert isinstance(build_policy("power_of_two"), AdapterPlacement)
    assert isinstance(build_policy("power_of_two", adapter_replicas=0), PowerOfTwo)
