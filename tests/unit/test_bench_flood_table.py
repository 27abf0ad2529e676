"""bench/serve_bench/flood_table.py: a gpu_flood call's arms against its bare arm, per load."""

from __future__ import annotations

import json

import pytest

from serve_bench import flood_table


def _result(p50: float | None, n: int, out: float, work: float | None) -> dict:
    flood = {"steady_output_tok_s": out}
    if work is not None:
        flood["steady_work_tok_s"] = work
    return {"quiet_under_flood_ttft_ms": {"p50": p50 if p50 is not None else float("nan"),
                                          "p99": p50, "max": p50, "n": n,
                                          "no_first_token": 0 if n else 1},
            "flood": flood}


def test_labels_split_into_the_arm_and_its_load():
    assert flood_table.split_label("stackpbp-max_num_batched_tokens-1536-2048-128-1024-16-s3") \
        == ("stackpbp-max_num_batched_tokens-1536", "2048-128-1024-16-s3")
    assert flood_table.split_label("bare-1024-128-128-16") == ("bare", "1024-128-128-16")
    with pytest.raises(ValueError):
        flood_table.split_label("1024-128-128-16")  # no arm


def test_each_arm_is_read_against_bare_on_its_own_load_regression_flood_share_taken_as_loss(
        tmp_path):
    """42j's call: the flood 0.970x bare's, the engine's work 1.003x; a second load's ratios
    come from that load's bare arm, not the first's."""
    files = {
        "bare-2048-128-1024-16-s3": _result(None, 0, 2042.9, 34729.9),
        "stackpbp-max_num_batched_tokens-1536-2048-128-1024-16-s3":
            _result(121.1, 28, 1981.4, 34849.3),
        "bare-1024-128-1024-16-s3": _result(None, 0, 4000.0, 36000.0),
        "stackpbp-max_num_batched_tokens-1536-1024-128-1024-16-s3":
            _result(125.0, 27, 3880.0, None),  # a record from before the work figure
    }
    for name, data in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    (tmp_path / "stack-config.json").write_text("{}")  # not a flood result: skipped
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line
            for line in flood_table.table({p: json.loads((tmp_path / f"{p}.json").read_text())
                                           for p in files}).splitlines()[2:]}
    stack2k = rows[("2048-128-1024-16-s3", "stackpbp-max_num_batched_tokens-1536")]
    assert "1981.4 (0.970x)" in stack2k and "34849.3 (1.003x)" in stack2k, stack2k
    stack1k = rows[("1024-128-1024-16-s3", "stackpbp-max_num_batched_tokens-1536")]
    assert "3880.0 (0.970x)" in stack1k and "| - (-) |" in stack1k, stack1k
    assert "- / - / - (0, 1)" in rows[("2048-128-1024-16-s3", "bare")]
    assert flood_table.main([str(tmp_path)]) == 0
