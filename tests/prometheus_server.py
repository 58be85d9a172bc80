"""A real Prometheus server (Debian's /usr/bin/prometheus) on its own port and storage, for the e2e tests,
and promtool (of the same package) run on files.

Where the binary is missing the test skips, or fails under ``CI=true``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from daemon import free_port, stop_process


def needed(binary: str, package: str) -> str:
    """The binary's path; skip (fail under CI=true) where it is not installed."""
    path = shutil.which(binary)
    if path is None:
        reason = f"{binary} is not installed (Debian package {package})"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {reason}", pytrace=False)
        pytest.skip(reason)
    return path


def promtool(*args: str, input: bytes | None = None, timeout: float = 120) -> None:
    """Run promtool with these arguments (and `input` on its stdin); fail with what it printed unless it
    exits 0."""
    result = subprocess.run([needed("promtool", "prometheus"), *args], input=input, capture_output=True,
                            timeout=timeout)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()


def one_target(target: str, **settings: Any) -> list[dict[str, Any]]:
    """The scrape configs of one job, ``atopgpud``, scraping `target` (``host:port``) with these settings."""
    return [{"job_name": "atopgpud", **settings, "static_configs": [{"targets": [target]}]}]


class Prometheus:
    """Prometheus scraping with the scrape configs given, every second, and evaluating the rule files given."""

    def __init__(self, binary: str, tmp: Path, scrape_configs: list[dict[str, Any]],
                 rule_files: list[str] | None = None) -> None:
        self.port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "rule_files": rule_files or [],
            "scrape_configs": scrape_configs,
        }
        (tmp / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.log_path = tmp / "prometheus.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as response:
            reply = json.load(response)
        assert reply["status"] == "success", reply
        return reply["data"]

    def query(self, expr: str, **params: str) -> list[dict]:
        return self.api("query", query=expr, **params)["result"]  # type: ignore[no-any-return]

    def wait_for(self, expr: str, timeout: float = 60.0) -> list[dict]:
        """The query's result once it has one."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}")
            try:
                result = self.query(expr)
            except OSError:
                result = []
            if result:
                return result
            time.sleep(0.5)
        targets = self.api("targets")["activeTargets"]
        raise AssertionError(f"no result for {expr} in {timeout} s; targets: {targets}")

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()
