"""A real Prometheus (Debian's ``prometheus``) scraping the running stack through the committed
scrape config, for the tests that check dashboards and alert rules against live series."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Iterator

import httpx
import yaml

from serve_app.observability.dashboards import DASHBOARD_DIR

from .ports import free_port

# `make test` unpacks Debian's prometheus into the venv and names it in PROMETHEUS_BIN.
PROMETHEUS = os.environ.get("PROMETHEUS_BIN") or shutil.which("prometheus")
MISSING = PROMETHEUS is None or not os.access(PROMETHEUS, os.X_OK)
WHY_MISSING = "no prometheus binary (`make prometheus` fetches Debian's)"


# The committed config's 5 s, shortened so that the tests see series sooner. Not to 1 s: a
# scrape times out at its interval, and Ray's metrics agent keeps the series of every app the
# suite ever ran: late in a make test run it served 7.2 MB in 1.3-1.5 s on the 2-core machine,
# and a CI run's LoRA panel test (1 s) saw no series in 60 s. Each scrape also costs the agent
# that much CPU, which the suite's other processes share.
SCRAPE_INTERVAL = "3s"


@contextlib.contextmanager
def running_prometheus(work: Path) -> Iterator[str]:
    """A Prometheus server using the committed scrape config (only its intervals shortened to
    :data:`SCRAPE_INTERVAL`), its data under ``work``; yields its URL once ready."""
    config = yaml.safe_load((DASHBOARD_DIR / "prometheus.yml").read_text())
    config["global"].update({"scrape_interval": SCRAPE_INTERVAL,
                             "scrape_timeout": SCRAPE_INTERVAL,
                             "evaluation_interval": SCRAPE_INTERVAL})
    for job in config["scrape_configs"]:
        for sd in job.get("file_sd_configs", []):
            sd["refresh_interval"] = "1s"
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(DASHBOARD_DIR / "alerts.yml", work / "alerts.yml")  # rule_files is relative
    port = free_port()
    log = open(work / "prometheus.log", "w")
    proc = subprocess.Popen(
        [str(PROMETHEUS), f"--config.file={work / 'prometheus.yml'}",
         f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (work / "prometheus.log").read_text()[-2000:]
            time.sleep(0.5)
        else:
            raise AssertionError("prometheus did not become ready in 60 s")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def targets_health(url: str) -> list[tuple[str, str, str, float]]:
    """Each active target of the Prometheus at ``url``: scrape URL, health, last error and last
    scrape's duration in seconds (for the message of a test that found no series)."""
    active = httpx.get(f"{url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
    return [(t["scrapeUrl"], t["health"], t.get("lastError", ""),
             round(float(t.get("lastScrapeDuration", 0.0)), 3)) for t in active]
