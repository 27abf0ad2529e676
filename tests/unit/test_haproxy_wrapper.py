"""The HAProxy wrapper runs Ray Serve's own HAProxy binary with kernel splicing off."""

from __future__ import annotations

import os
import subprocess

from serve_app.ingress import haproxy


def test_wrapper_runs_the_bundled_binary_without_splicing(tmp_path):
    path = haproxy.write_wrapper(tmp_path)
    assert os.access(path, os.X_OK)
    text = path.read_text()
    assert haproxy.real_binary() in text and f" {haproxy.NO_SPLICE_FLAG} " in text
    # It really starts HAProxy (the version banner), with the flag accepted.
    out = subprocess.run([str(path), "-v"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("HAProxy version"), out


def test_wrapper_is_rewritten_only_when_it_changes(tmp_path):
    first = haproxy.write_wrapper(tmp_path, binary="/opt/haproxy")
    stamp = first.stat().st_mtime_ns
    assert haproxy.write_wrapper(tmp_path, binary="/opt/haproxy").stat().st_mtime_ns == stamp
    again = haproxy.write_wrapper(tmp_path, binary="/opt/other haproxy")
    assert "'/opt/other haproxy' -dS" in again.read_text()
    assert list(tmp_path.iterdir()) == [again]  # no partial file left behind


def test_a_wrapper_written_under_a_running_stack_runs_haproxy_regression_self_exec(
        tmp_path, monkeypatch):
    """A process started under a running stack inherits RAY_SERVE_HAPROXY_BINARY_PATH pointing
    at the wrapper; the wrapper it wrote exec'd itself forever, so HAProxy never started (the
    two-node test cluster's Serve failed to start, and this file's `-v` test hung after it)."""
    first = haproxy.write_wrapper(tmp_path)
    monkeypatch.setenv(haproxy.BINARY_ENV, str(first))
    second = haproxy.write_wrapper(tmp_path)  # the same file, as every process writes it
    assert f"exec {first} " not in second.read_text()
    out = subprocess.run([str(second), "-v"], capture_output=True, text=True, timeout=10)
    assert out.returncode == 0 and out.stdout.startswith("HAProxy version"), out
    assert os.environ[haproxy.BINARY_ENV] == str(first)  # the operator's setting is kept
