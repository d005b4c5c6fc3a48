"""A schema fuzz of the native API: schemathesis reads /openapi.json from the real gunicorn server and sends
what the document allows and what it does not (coverage, fuzzing and stateful phases, positive and negative
data), checking every answer against the document.

Bounded: ``MAX_EXAMPLES`` cases per operation and phase, a fixed seed, bodies of at most ~100 KB (the
fuzzer's own sizes; nothing here asks for more): about 1,650 requests in under a minute on 2 cores.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness.launch import GunicornServer

pytestmark = pytest.mark.e2e

MAX_EXAMPLES = 50
MIN_REQUESTS = 1000
SEED = 20250101  # fixed: a failure reproduces with the same command; change it to explore further
FUZZ_TIMEOUT_S = 300
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_schema_conformance", "response_headers_conformance")
# A deadline shortened to nanoseconds is a 504 by contract (tests/unit/http/test_api.py checks it); the fuzz sends one
# the work fits in, so that every 5xx it sees is a server fault.
CONFIG = """
[parameters]
"header.X-Request-Timeout" = "30"
"""


def fuzz_command(url: str, config: Path, report: Path) -> list[str]:
    """The schemathesis run (``python -m schemathesis.cli`` is the ``schemathesis`` command)."""
    return [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run", url + "/openapi.json",
            "--checks", ",".join(CHECKS), "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED),
            "--request-timeout", "30", "--generation-database", "none", "--no-color",
            "--report", "ndjson", "--report-ndjson-path", str(report)]


@dataclass
class Tally:
    """What the run's NDJSON events say: every request sent, its status and worker, every failed check."""

    requests: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    pids: set[int] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, report: Path) -> Tally:
        tally = cls()
        for line in report.read_text().splitlines():
            (kind, event), = json.loads(line).items()
            if kind == "NonFatalError":
                tally.failures.append(f"error: {event.get('info', event)}")
            if kind != "ScenarioFinished":
                continue
            recorder = event["recorder"]
            for interaction in recorder.get("interactions", {}).values():
                tally.add(recorder["label"], interaction)
            for checks in recorder.get("checks", {}).values():
                tally.failures += [f"{recorder['label']}: {c['name']}: {c.get('failure_info')}"
                                   for c in checks if c["status"] != "success"]
        return tally

    def add(self, label: str, interaction: dict) -> None:
        self.requests += 1
        response = interaction.get("response")
        if response is None:
            self.failures.append(f"{label}: no response")
            return
        self.statuses[response["status_code"]] += 1
        self.pids |= {int(pid) for pid in response["headers"].get("x-worker-pid", [])}
        if response["status_code"] >= 500:
            body = base64.b64decode(response.get("content", {}).get("$base64", "")).decode(errors="replace")
            self.failures.append(f"{label}: {response['status_code']} {body[:300]}")


def test_schema_fuzz_finds_no_5xx_and_nothing_the_document_does_not_say(server: GunicornServer,
                                                                        tmp_path: Path) -> None:
    pids = server.worker_pids()
    assert len(pids) == 2 and server.healthz_pids() == pids
    config, report = tmp_path / "schemathesis.toml", tmp_path / "events.ndjson"
    config.write_text(CONFIG)
    t0 = time.monotonic()
    run = subprocess.run(fuzz_command(server.url, config, report), cwd=tmp_path, capture_output=True, text=True,
                         timeout=FUZZ_TIMEOUT_S)
    seconds = time.monotonic() - t0
    tally = Tally.read(report)
    summary = (f"{tally.requests} requests in {seconds:.0f}s, statuses {dict(sorted(tally.statuses.items()))}, "
               f"{len(tally.failures)} failures")
    print(summary)  # the figures, with -s
    assert run.returncode == 0 and not tally.failures, f"{summary}\n{tally.failures[:20]}\n{run.stdout[-6000:]}"
    assert tally.requests >= MIN_REQUESTS, summary
    assert not any(status >= 500 for status in tally.statuses), summary
    assert tally.pids == pids, "answers came from other processes than the workers started with"
    assert server.worker_pids() == pids and server.healthz_pids() == pids, "a worker died or was replaced"
