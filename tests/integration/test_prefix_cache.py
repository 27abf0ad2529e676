"""The ``prefix_cache`` routing policy end to end: three scripted-engine replicas of one model
behind two router replicas (HAProxy spreads the requests over them), Serve, the replicas'
records of what they served and the routers' engine feeds carrying them.

Which replica served a request is read from the replicas' request counters (``requests_total``,
as `serve-app status` shows them), one request at a time. A replica is made busy with long
requests that share a session key (``prompt_cache_key``), so that they stay together on the
replica the key's rendezvous order names. The policy reads the loads the replicas report on
the engine feed (every router the same), so a phase that needs the replicas idle waits for the
busy requests to end and for one more poll.

The scripted engine has no prefix cache: what is checked is where requests go, not what the
engine then finds cached (tests/integration/test_prefix_affinity.py measures that on vLLM).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import httpx
import pytest

from serve_app.engine.protocol import GenerationRequest, SamplingOptions
from serve_app.governance.keys import Tenant
from serve_app.routing.prefix_affinity import rendezvous_order
from serve_app.routing.prefix_blocks import BlockHasher

from .conftest import wait_until

pytestmark = pytest.mark.integration

APP = "prefix-cache"
PREFIX = "/prefix-cache"
MODEL = "tiny-prefix-cache"
TENANT = "team-a"
HASHER = BlockHasher(block_tokens=16, chars_per_token=4)  # blocks of 64 characters
FEED_POLL_S = 0.05
SYSTEM = {"role": "system", "content": ("You answer questions about the team handbook, "
                                        "citing its sections. " * 6)}


def _turns(name: str, n: int, system: dict[str, str] = SYSTEM) -> list[list[dict[str, str]]]:
    """Session ``name``'s first ``n`` requests: each sends the system prompt and the history."""
    history, out = [system], []
    for k in range(n):
        history = history + [{"role": "user", "content": f"{name}, turn {k}: " + "why so? " * 8}]
        out.append(history)
        history = history + [{"role": "assistant", "content": f"Answer {k} for {name}. " * 4}]
    return out


def _first_choice(replica_ids: list[str], **request: object) -> str:
    """Where a request of TENANT goes among idle replicas holding nothing of it: the rendezvous
    order of its session's hash, else of its first block's."""
    found = HASHER.of(GenerationRequest("r", SamplingOptions(),
                                        cache_salt=Tenant(TENANT).cache_salt,
                                        **request))  # type: ignore[arg-type]
    first = found.session if found.session is not None else found.blocks[0]
    return rendezvous_order(first.to_bytes(8, "big"), replica_ids)[0]


@pytest.fixture(scope="module")
def app(stack):
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import AutoscalingSettings, ModelSettings
    from serve_app.config.routing import RoutingSettings
    from serve_app.engine.scripted import SCRIPTED_ENGINE_CLASS

    model = ModelSettings(
        name=MODEL, path=str(stack["path"]), device="cpu", max_model_len=4096,
        engine_kwargs={"max_num_seqs": 16, "scripted_step_s": 0.02},
        autoscaling=AutoscalingSettings(min_replicas=3, max_replicas=3),
        routing=RoutingSettings(policy="prefix_cache", block_tokens=HASHER.block_tokens,
                                chars_per_token=HASHER.chars_per_token, imbalance_margin=4,
                                request_cost_tokens=64))
    cfg = stack["config"]
    routers = cfg.router.model_copy(update={"num_replicas": 2, "admission": (
        cfg.router.admission.model_copy(update={"idle_poll_interval_s": FEED_POLL_S}))})
    cfg = cfg.model_copy(update={"models": [model], "router": routers})
    serve.run(build_app(cfg, SCRIPTED_ENGINE_CLASS), name=APP, route_prefix=PREFIX,
              blocking=False)
    router = serve.get_deployment_handle("Router", app_name=APP)
    headers = {"Authorization": f"Bearer {stack['keys'][TENANT]}"}

    def counts() -> dict[str, int]:
        """Replica id -> requests it has taken, as one router's engine feed last saw them."""
        state = router.admission_state.remote().result(timeout_s=30)[MODEL]
        return {r["replica"]: r["requests_total"] for r in state["per_replica"]}

    def post(**body: object) -> httpx.Response:
        chat = "messages" in body
        return httpx.post(f"{stack['base']}{PREFIX}/v1/{'chat/' if chat else ''}completions",
                          timeout=120, headers=headers,
                          json={"model": MODEL, "max_tokens": 2, **body})

    def settled(at_least: int = 0) -> dict[str, int]:
        """The three replicas' counts once they sum to ``at_least`` or more and read the same
        six times in a row: the handle picks a router each time, and one router's feed can be
        a poll behind the other's (a total read from the stale one was never seen again)."""
        last, in_a_row = [None], [0]

        def same() -> dict[str, int] | None:
            x = counts()
            ok = len(x) == 3 and sum(x.values()) >= at_least
            in_a_row[0] = (in_a_row[0] + 1 if x == last[0] else 1) if ok else 0
            last[0] = x
            return x if in_a_row[0] >= 6 else None
        return wait_until(same, 30)

    def send(**body: object) -> str:
        """One request; the replica that took it."""
        before = settled()
        r = post(**body)
        assert r.status_code == 200, r.text
        after = settled(sum(before.values()) + 1)
        (served,) = [rid for rid, n in after.items() if n > before.get(rid, 0)]
        return served

    def ids() -> list[str]:
        """The three replicas' ids (a router whose feed has not started yet knows none)."""
        return wait_until(lambda: len(x := counts()) == 3 and sorted(x), 30)

    def state() -> list[dict]:
        return router.admission_state.remote().result(timeout_s=30)[MODEL]["per_replica"]

    def steadily(check: Callable[[list[dict]], bool], what: str) -> None:
        """Wait until ``check`` holds for the feed's view on six reads in a row (the handle
        picks a router each time, so both routers' feeds are read)."""
        in_a_row, seen = [0], []

        def held() -> bool:
            seen[:] = state()
            in_a_row[0] = in_a_row[0] + 1 if check(seen) else 0
            return in_a_row[0] >= 6
        try:
            wait_until(held, 30, FEED_POLL_S)
        except AssertionError:
            raise AssertionError(f"{what}; last read: {seen}") from None

    def quiet() -> None:
        """Wait until the feed shows every replica holding nothing: a request whose response
        has arrived may still count on its replica for a poll, and the policy sends a request
        cached nowhere to the least-loaded replica."""
        steadily(lambda seen: len(seen) == 3 and not any(
            max(r["active"], r["running"] + r["waiting"]) for r in seen),
            "the replicas did not go quiet")

    def busy(replica: str, n: int = 3) -> ThreadPoolExecutor:
        """``n`` long requests (4 s each) on ``replica``: a session key whose rendezvous order
        names it, sent with every replica idle, the first request alone until the routers
        know the session is there."""
        quiet()
        ids_now = ids()
        key = next(k for k in (f"busy-{i}" for i in range(1000))
                   if _first_choice(ids_now, prompt="x", session=k) == replica)
        pool = ThreadPoolExecutor(n)
        body = {"prompt": f"busy work {time.monotonic()}", "prompt_cache_key": key,
                "max_tokens": 200, "ignore_eos": True}
        futures = [pool.submit(post, **body)]

        def on(seen: list[dict], rid: str, at_least: int) -> bool:
            return any(r["replica"] == rid and r["active"] >= at_least for r in seen)
        # Started, recorded by the replica and seen on the feed; judged on the read that first
        # shows it (the next read may come from the other router, whose poll is still due).
        started = wait_until(lambda: (seen := state()) and any(
            on(seen, r, 1) for r in ids_now) and seen, 30, FEED_POLL_S)
        assert on(started, replica, 1), ("the busy work did not start on its replica",
                                         replica, started)
        steadily(lambda seen: on(seen, replica, 1),
                 "both routers did not see the busy work")  # then they send the rest there
        futures += [pool.submit(post, **body) for _ in range(n - 1)]
        wait_until(lambda: on(state(), replica, n), 30, FEED_POLL_S)
        pool.futures = futures  # type: ignore[attr-defined]
        return pool

    def idle(pool: ThreadPoolExecutor) -> None:
        """Wait for the busy requests to end and the routers' feeds to see it."""
        assert all(f.result().status_code == 200 for f in pool.futures)  # type: ignore[attr-defined]
        pool.shutdown()
        quiet()

    last: list[object] = []

    def ready() -> bool:
        try:
            seen, r = counts(), post(prompt="hi", max_tokens=1)
            last[:] = [seen, r.status_code, r.text[:300]]
            return len(seen) == 3 and r.status_code == 200
        except (httpx.HTTPError, KeyError) as err:
            last[:] = [repr(err)]
            return False

    try:
        wait_until(ready, 240, 0.5)
    except AssertionError:
        raise AssertionError(f"the three-replica app is not ready: {last}") from None

    def both_routers_see_three() -> bool:
        """A router's engine feed starts with its first request: until both routers have had
        one, a read of the one without work shows no replica (the handle picks a router per
        read; ten reads all on one router: 0.2%)."""
        for _ in range(10):
            if len(state()) != 3:
                post(prompt="hi", max_tokens=1)
                return False
        return True
    wait_until(both_routers_see_three, 120, 0.2)

    yield {"send": send, "busy": busy, "idle": idle, "counts": counts, "ids": ids, "state": state,
           "quiet": quiet,
           "sessions": {}}
    serve.delete(APP)


def test_a_six_turn_session_stays_on_one_replica(app):
    """The session starts while the replica its prompt would go to by default is busy, so it
    lands elsewhere; its next five turns, sent with every replica idle, follow its history
    there (without the index they would go back to the default replica)."""
    ids = app["ids"]()
    turns = _turns("s1", 6)
    default = _first_choice(ids, messages=turns[0])
    work = app["busy"](default)
    first = app["send"](messages=turns[0])
    app["idle"](work)
    assert first != default
    served = [first] + [app["send"](messages=t) for t in turns[1:]]
    assert served == [first] * 6, served
    app["sessions"]["s1"] = first


def test_a_second_session_with_the_same_system_prompt_goes_where_the_load_is_lower(app):
    """The first session's replica caches the system prompt and is busy: the second session's
    first turn goes to another replica (the prefill saved is worth less than the queue), and
    its next turns, sent idle, follow it there."""
    home = app["sessions"]["s1"]
    turns = _turns("s2", 3)
    work = app["busy"](home)
    state = app["state"]()
    first = app["send"](messages=turns[0])
    app["idle"](work)
    assert first != home, (home, state)
    assert [app["send"](messages=t) for t in turns[1:]] == [first] * 2
    app["sessions"]["s2"] = first


def test_two_routers_agree(app):
    """Eight copies of the first session's latest turn, one at a time: HAProxy spreads them
    over both routers (least connections, alternating when idle), and every one lands on the
    session's replica, which is not where the prompt would go by default."""
    ids = app["ids"]()
    turn = _turns("s1", 6)[-1]
    assert _first_choice(ids, messages=turn) != app["sessions"]["s1"]
    assert {app["send"](messages=turn) for _ in range(8)} == {app["sessions"]["s1"]}


def test_removing_a_replica_moves_only_its_prefixes(app):
    """A third session (its own key) lives on the replica neither other session uses; that
    replica is killed (Serve starts another). The third session moves; the first two stay
    where their histories are."""
    import ray
    from ray.util.state import list_actors

    s1, s2 = app["sessions"]["s1"], app["sessions"]["s2"]
    ids = app["ids"]()
    (third,) = [rid for rid in ids if rid not in (s1, s2)]
    key = next(k for k in (f"s3-{i}" for i in range(1000))
               if _first_choice(ids, prompt="x", session=k) == third)
    # Its own system prompt: nothing of it is cached anywhere, so its key's order places it.
    s3 = _turns("s3", 2, {"role": "system", "content": "You summarise release notes. " * 8})
    assert app["send"](messages=s3[0], prompt_cache_key=key) == third
    (actor,) = [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
                if a.name and a.name.endswith(f"#{third}")]
    ray.kill(ray.get_actor(actor.name, namespace="serve"), no_restart=True)
    wait_until(lambda: (x := app["counts"]()) and third not in x and len(x) == 3, 120, 0.5)
    app["quiet"]()
    moved = app["send"](messages=s3[1], prompt_cache_key=key)
    assert moved != third
    assert app["send"](messages=_turns("s1", 7)[-1]) == s1
    assert app["send"](messages=_turns("s2", 4)[-1]) == s2
