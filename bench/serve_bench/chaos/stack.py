"""The chaos stack's shape: the embedded default reshaped so a CPU host can saturate it.

:func:`chaos_config` returns a copy of the given config with its first model only, pinned to
``REPLICAS`` engine replicas of ``max_num_seqs`` ``BATCH``, the router on ``port`` with a queue
of ``QUEUE`` per band, admission headroom ``HEADROOM`` polled every 50 ms and a stream stall
limit of ``stall_s``, and exactly the ``TENANTS`` (name: priority), each with a fresh key; the
keys come back by tenant name. The scenarios compute their bounds from these constants (one
replica holds ``BATCH + 2 * HEADROOM``, capacity is ``REPLICAS * (BATCH + HEADROOM)``), so they
change here only.
"""

from __future__ import annotations

from serve_app.config import AppConfig, TenantSettings

BATCH = 4  # max_num_seqs per engine replica: a small batch saturates on the CPU
HEADROOM = 2
QUEUE = 24  # router.max_queued_per_band
REPLICAS = 2
TENANTS = {"chaos-a": "normal", "chaos-b": "high"}
STALL_S = 5.0  # router.stream_stall_timeout_s of the chaos stack (--stall-s)


def chaos_config(base: AppConfig, port: int, stall_s: float = STALL_S
                 ) -> tuple[AppConfig, dict[str, str]]:
    """The embedded default with two engine replicas of a small batch, a short router queue and
    two tenants (fresh keys); returns the config and the keys."""
    from serve_app.governance.keys import key_digest, new_key

    keys = {name: new_key() for name in TENANTS}
    model = base.models[0]
    model = model.model_copy(update={
        "engine_kwargs": {**model.engine_kwargs, "max_num_seqs": BATCH},
        "autoscaling": model.autoscaling.model_copy(update={"min_replicas": REPLICAS,
                                                            "max_replicas": REPLICAS})})
    router = base.router.model_copy(update={
        "port": port, "max_queued_per_band": QUEUE, "stream_stall_timeout_s": stall_s,
        "admission": base.router.admission.model_copy(update={"headroom": HEADROOM,
                                                              "poll_interval_s": 0.05})})
    tenants = [TenantSettings(name=n, api_key_sha256=[key_digest(keys[n])], priority=p)
               for n, p in TENANTS.items()]
    return base.model_copy(update={"models": [model], "router": router,
                                   "tenants": tenants}), keys
