"""The timeout nesting of deploy/TIMEOUTS.md, checked on every artefact that sets one (with the values it
ships): a request gives up from the inside out, and a drain fits inside what the supervisor allows."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from harness.launch import ROOT
from service.settings import Settings

DEPLOY = ROOT / "deploy"
yaml = pytest.importorskip("yaml")


def env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if re.match(r"^[A-Z_]+=", line))
    return {k: v for k, v in pairs}


def shipped(**overrides: str) -> Settings:
    """The settings an artefact runs with: the defaults, under its own GREENSERVE_* values."""
    return Settings.from_env({k: v for k, v in overrides.items() if k.startswith("GREENSERVE_")})


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m)?", value.strip())
    assert match, f"not a duration: {value!r}"
    return int(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60, None: 1}[match.group(2)]


def nginx_read_timeouts() -> dict[str, float]:
    """``proxy_read_timeout`` per location of the shipped config (location path → seconds)."""
    text = (DEPLOY / "nginx" / "greenserve.conf").read_text()
    found = {}
    for location, body in re.findall(r"location\s+(?:=\s*)?(\S+)\s*\{(.*?)\}", text, re.S):
        match = re.search(r"proxy_read_timeout\s+(\S+);", body)
        server_level = re.search(r"^\s*proxy_read_timeout\s+(\S+);", text, re.M)
        value = match.group(1) if match else server_level.group(1) if server_level else "60s"  # nginx's default
        found[location] = seconds(value)
    return found


def unit_stop_timeout(path: Path) -> float:
    match = re.search(r"^TimeoutStopSec=(\S+)$", path.read_text(), re.M)
    assert match, f"{path.name} sets no TimeoutStopSec (systemd's default 90 s is not stated)"
    return seconds(match.group(1))


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    if doc["kind"] == "InferenceService":
        return doc["spec"]["predictor"]
    return doc["spec"]["template"]["spec"]


def prestop_seconds(container: dict[str, Any]) -> float:
    hook = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    command = hook.get("exec", {}).get("command", [])
    return float(command[-1]) if command[:1] == ["sleep"] else 0.0


def test_a_request_gives_up_from_the_inside_out() -> None:
    systemd = shipped(**env_file(DEPLOY / "greenserve.env"))
    timeouts = nginx_read_timeouts()
    assert "/" in timeouts, "the nginx config has no catch-all location"
    assert systemd.request_timeout_s < timeouts["/"] < systemd.worker_timeout_s, (
        "GREENSERVE_REQUEST_TIMEOUT_S < nginx proxy_read_timeout < GREENSERVE_WORKER_TIMEOUT_S", timeouts)
    assert all(t < systemd.worker_timeout_s for t in timeouts.values())


def test_nginx_lets_go_of_an_upstream_connection_before_gunicorn_does() -> None:
    text = (DEPLOY / "nginx" / "greenserve.conf").read_text()
    upstream = re.search(r"upstream\s+\S+\s*\{(.*?)\}", text, re.S)
    assert upstream
    keepalive = re.search(r"keepalive_timeout\s+(\S+);", upstream.group(1))
    assert keepalive and seconds(keepalive.group(1)) < Settings().keepalive_s


@pytest.mark.parametrize("unit", ["greenserve.service", "greenserve@.service"])
def test_systemd_lets_the_drain_finish(unit: str) -> None:
    settings = shipped(**env_file(DEPLOY / "greenserve.env"))
    assert settings.graceful_timeout_s < unit_stop_timeout(DEPLOY / unit)


@pytest.mark.parametrize("manifest", ["k8s/deployment.yaml", "kserve/inferenceservice.yaml"])
def test_kubernetes_grace_covers_prestop_and_the_drain(manifest: str) -> None:
    path = DEPLOY / manifest
    if not path.exists():
        pytest.fail(f"{manifest} is missing")
    config = {k: str(v) for d in documents(DEPLOY / "k8s" / "configmap.yaml") for k, v in d.get("data", {}).items()}
    for doc in documents(path):
        spec = pod_spec(doc)
        container = spec["containers"][0]
        env = {**config, **{e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}}
        settings = shipped(**env)
        grace = float(spec.get("terminationGracePeriodSeconds", 30))
        assert settings.graceful_timeout_s < grace - prestop_seconds(container), (manifest, grace)
        assert settings.request_timeout_s < settings.worker_timeout_s
