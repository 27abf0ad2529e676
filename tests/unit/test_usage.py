"""The usage record (one JSON line per request) and `serve-app usage` (pure; files in tmp)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from serve_app.cli import main
from serve_app.config import UsageSettings
from serve_app.governance.usage import (FIELDS, UsageLog, parse_since, read_records,
                                           summarize, usage_files)


def _line(tenant: str, model: str = "m", prompt: int = 10, completion: int = 5,
          status: int = 200, time: str = "2026-12-01T10:00:00+00:00", **extra) -> dict:
    return {"time": time, "tenant": tenant, "model": model, "prompt_tokens": prompt,
            "completion_tokens": completion, "status": status, **extra}


def test_a_line_has_exactly_the_named_fields_and_nothing_a_caller_adds(tmp_path):
    log = UsageLog(UsageSettings(dir=str(tmp_path)), "replica/1")
    log.record(request_id="cmpl-1", tenant="a", model="m", prompt_tokens=3,
               completion_tokens=4, status=200, api_key="sk-sa-secret", prompt="the prompt")
    files = usage_files([tmp_path])
    assert [f.name for f in files] == ["usage-replica_1.jsonl"]
    text = files[0].read_text()
    rec = json.loads(text)
    assert tuple(rec) == FIELDS and rec["cached_tokens"] is None
    assert "sk-sa-secret" not in text and "the prompt" not in text
    assert datetime.fromisoformat(rec["time"]).tzinfo is not None


def test_off_by_default_writes_nothing(tmp_path):
    log = UsageLog(UsageSettings(), "r")
    assert not log.enabled and log.path is None
    log.record(tenant="a")


def test_rotated_files_are_read_oldest_first(tmp_path):
    log = UsageLog(UsageSettings(dir=str(tmp_path), max_bytes=1024, backups=20), "r")
    for i in range(40):
        log.record(request_id=f"cmpl-{i}", tenant="a", model="m", prompt_tokens=1,
                   completion_tokens=i, status=200)
    files = usage_files([tmp_path])
    assert len(files) > 2  # it rotated
    ids = [r["request_id"] for r in read_records(files)]
    assert ids == [f"cmpl-{i}" for i in range(40)]


def test_summary_per_tenant_and_model_with_filters():
    recs = [_line("a"), _line("a", completion=7), _line("a", model="m2"), _line("b"),
            _line("b", status=429, prompt=0, completion=0),
            _line("a", time="2026-11-01T00:00:00+00:00", prompt=1000)]
    totals = summarize(recs)
    assert totals[("a", "m")].requests == 3 and totals[("a", "m")].prompt_tokens == 1020
    assert totals[("b", "m")].errors == 1 and totals[("b", "m")].total_tokens == 15
    since = summarize(recs, since=datetime(2026, 12, 1, tzinfo=timezone.utc), tenant="a")
    assert set(since) == {("a", "m"), ("a", "m2")}
    assert since[("a", "m")].prompt_tokens == 20 and since[("a", "m")].completion_tokens == 12


def test_since_takes_spans_and_dates():
    now = datetime(2026, 12, 3, 12, tzinfo=timezone.utc)
    assert parse_since("24h", now) == now - timedelta(hours=24)
    assert parse_since("7d", now) == now - timedelta(days=7)
    assert parse_since("2026-12-01", now) == datetime(2026, 12, 1, tzinfo=timezone.utc)
    with pytest.raises(ValueError, match="24h"):
        parse_since("yesterday", now)


def test_cli_sums_a_folder(tmp_path, capsys):
    (tmp_path / "usage-r1.jsonl").write_text(
        "\n".join(json.dumps(r) for r in (_line("a"), _line("b"))) + "\nnot json\n")
    (tmp_path / "usage-r2.jsonl").write_text(json.dumps(_line("a", completion=1)) + "\n")
    assert main(["usage", "--file", str(tmp_path), "--tenant", "a", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows == [{"tenant": "a", "model": "m", "requests": 2, "errors": 0,
                     "prompt_tokens": 20, "completion_tokens": 6, "cached_tokens": 0,
                     "total_tokens": 26}]
    assert main(["usage", "--file", str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["tenant", "model", "requests", "errors", "prompt",
                                "completion", "cached", "total"]
    assert len(table) == 3
    assert main(["usage", "--file", str(tmp_path / "nope.jsonl")]) == 2
    assert main(["usage", "--file", str(tmp_path), "--since", "yesterday"]) == 2
