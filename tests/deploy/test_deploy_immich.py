"""deploy/immich, without docker or a cluster: the Compose fragment, the systemd settings file and the kustomization
each give a server that starts (greenserve's own settings validation), serves immich's default Smart Search model
under the name immich asks for, and reaches immich's machine-learning service for faces and OCR; immich reaches
greenserve on the port it listens on."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from harness.launch import ROOT
from service import catalog
from service.engine.model_set import model_set
from service.http.model_names import IMMICH_SEPARATOR, resolve_immich
from service.settings import Settings, env_name

IMMICH_DIR = ROOT / "deploy" / "immich"
K8S_DIR = IMMICH_DIR / "k8s"
K8S_VERSION = "1.37"  # as tests/deploy/test_k8s.py
SETTINGS = {env_name(f.name) for f in dataclasses.fields(Settings)}
# immich's side (repository immich-app/immich): its default Smart Search model (server/src/config.ts,
# machineLearning.clip.modelName), its machine-learning container's port, and the services of its
# docker/docker-compose.yml, which the fragment merges into
IMMICH_DEFAULT_CLIP = "ViT-B-32__openai"
IMMICH_ML_PORT = 3003
IMMICH_SERVICES = {"immich-server", "immich-machine-learning", "redis", "database"}
# immich's Helm chart labels its machine-learning pods so (nameOverride machine-learning, release immich)
IMMICH_ML_LABELS = {"app.kubernetes.io/name": "machine-learning", "app.kubernetes.io/instance": "immich"}
# a stand-in for immich's docker-compose.yml: its services and project name, without its .env
IMMICH_COMPOSE = """
name: immich
services:
  immich-server: {image: ghcr.io/immich-app/immich-server:release, depends_on: [redis, database]}
  immich-machine-learning: {image: ghcr.io/immich-app/immich-machine-learning:release}
  redis: {image: docker.io/valkey/valkey:8-bookworm}
  database: {image: ghcr.io/immich-app/postgres:14-vectorchord0.4.3-pgvectors0.2.0}
"""


def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def compose() -> dict[str, Any]:
    (doc,) = load(IMMICH_DIR / "docker-compose.yml")
    return doc


def env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if re.match(r"^[A-Z_]+=", line))
    return {k: v for k, v in pairs}


def image_bind() -> str:
    """The image's GREENSERVE_BIND (Containerfile ENV), what the Compose service listens on unless it sets one."""
    m = re.search(r"^\s*GREENSERVE_BIND=(\S+)", (ROOT / "Containerfile").read_text(), re.M)
    assert m, "the Containerfile sets no GREENSERVE_BIND"
    return m.group(1)


def compose_env() -> dict[str, str]:
    environment = compose()["services"]["greenserve"]["environment"]
    assert isinstance(environment, dict), "the fragment's greenserve environment is a mapping"
    return {"GREENSERVE_BIND": image_bind(), **{k: str(v) for k, v in environment.items()}}


def one(kind: str, path: Path) -> dict[str, Any]:
    (doc,) = [d for d in load(path) if d["kind"] == kind]
    return doc


def kustomization() -> dict[str, Any]:
    (doc,) = load(K8S_DIR / "kustomization.yaml")
    return doc


def config_map() -> dict[str, Any]:
    """deploy/k8s's ConfigMap with the kustomization's patch applied (a ConfigMap's data merges key by key)."""
    base = one("ConfigMap", ROOT / "deploy" / "k8s" / "configmap.yaml")
    (patch,) = [yaml.safe_load(p["patch"]) for p in kustomization()["patches"] if p["target"]["kind"] == "ConfigMap"]
    assert patch["metadata"]["name"] == base["metadata"]["name"]
    return {**base, "data": {**base["data"], **patch["data"]}}


def k8s_env() -> dict[str, str]:
    """What the pod sees: the patched ConfigMap, then the Deployment's literal env."""
    (c,) = one("Deployment", ROOT / "deploy" / "k8s" / "deployment.yaml")["spec"]["template"]["spec"]["containers"]
    return {**config_map()["data"], **{e["name"]: e["value"] for e in c["env"] if "value" in e}}


SOURCES = {"compose": compose_env, "systemd": lambda: env_file(IMMICH_DIR / "greenserve.env"), "k8s": k8s_env}


def settings_of(env: dict[str, str]) -> Settings:
    names = {k for k in env if k.startswith("GREENSERVE_")}
    assert names <= SETTINGS, sorted(names - SETTINGS)
    return Settings.from_env({k: env[k] for k in names})  # raises, naming the variable, on a bad value


def port_of(url: str) -> int:
    parts = urlsplit(url)
    return parts.port or {"http": 80, "https": 443}[parts.scheme]


# ------------------------------------------------------------------ every source


@pytest.mark.parametrize("source", SOURCES)
def test_settings_pass_greenserves_validation(source: str) -> None:
    env = SOURCES[source]()
    settings = settings_of(env)
    assert settings.immich_upstream
    assert env.get("HF_HUB_OFFLINE", "1") == "1"  # the image sets it for compose; never a download at start


@pytest.mark.parametrize("source", SOURCES)
def test_served_models_are_immich_names_the_master_accepts(source: str) -> None:
    for spec in model_set(settings_of(SOURCES[source]())):
        family, _, name = spec.model.partition(":")
        assert family == "open_clip" and IMMICH_SEPARATOR in name, f"{spec.model}: not served the immich way"
        catalog.check(spec.model)  # what gunicorn's master checks before it forks


@pytest.mark.parametrize("source", SOURCES)
def test_immichs_default_model_and_every_served_name_resolve_to_themselves(source: str) -> None:
    specs = model_set(settings_of(SOURCES[source]()))
    configured = {s.name: (s.model, s.weights) for s in specs}
    assert resolve_immich(configured, IMMICH_DEFAULT_CLIP) == IMMICH_DEFAULT_CLIP
    for name in configured:
        assert resolve_immich(configured, name) == name


@pytest.mark.parametrize("source", SOURCES)
def test_faces_and_ocr_go_to_immichs_machine_learning_port(source: str) -> None:
    upstream = settings_of(SOURCES[source]()).immich_upstream
    assert port_of(upstream) == IMMICH_ML_PORT
    if source != "systemd":  # the same host there
        assert urlsplit(upstream).hostname == "immich-machine-learning"


# ------------------------------------------------------------------ Compose


def test_compose_fragment_overrides_immichs_services_and_adds_greenserve() -> None:
    services = compose()["services"]
    assert set(services) - IMMICH_SERVICES == {"greenserve"}
    for name in set(services) & IMMICH_SERVICES:  # merged into immich's: its image and the rest stay immich's
        assert set(services[name]) <= {"environment", "depends_on"}, name
    assert "ports" not in services["greenserve"]  # reachable on Compose's network only: no token needed


def test_compose_points_immich_at_greenserves_port() -> None:
    server = compose()["services"]["immich-server"]
    url = server["environment"]["IMMICH_MACHINE_LEARNING_URL"]
    assert urlsplit(url).hostname == "greenserve"
    assert port_of(url) == int(compose_env()["GREENSERVE_BIND"].rsplit(":", 1)[1])
    assert "greenserve" in server["depends_on"]


def test_compose_mounts_the_weights_where_the_image_looks() -> None:
    doc = compose()
    (mount,) = doc["services"]["greenserve"]["volumes"]
    volume, path, mode = mount.split(":")
    assert volume in doc["volumes"] and mode == "ro"
    hf_home = re.search(r"^\s*HF_HOME=(\S+)", (ROOT / "Containerfile").read_text(), re.M)
    assert hf_home and hf_home.group(1).startswith(path + "/")


def has_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.skipif(not has_compose(), reason="docker compose not installed")
def test_docker_compose_merges_the_fragment_into_immichs_file(tmp_path: Path) -> None:
    (tmp_path / "docker-compose.yml").write_text(IMMICH_COMPOSE)
    r = subprocess.run(["docker", "compose", "-f", str(tmp_path / "docker-compose.yml"),
                        "-f", str(IMMICH_DIR / "docker-compose.yml"), "config", "--format", "json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    services = json.loads(r.stdout)["services"]
    assert services["immich-server"]["image"].startswith("ghcr.io/immich-app/")
    assert {"redis", "database", "greenserve"} <= set(services["immich-server"]["depends_on"])
    expected = compose()["services"]["greenserve"]["environment"]
    assert {k: str(v) for k, v in expected.items()}.items() <= services["greenserve"]["environment"].items()


# ------------------------------------------------------------------ Kubernetes


def test_kustomization_resources_exist() -> None:
    for resource in kustomization()["resources"]:
        path = K8S_DIR / resource
        assert path.is_file() or (path / "kustomization.yaml").is_file(), resource


@pytest.mark.parametrize("doc", [pytest.param(config_map, id="ConfigMap"),
                                 pytest.param(lambda: one("NetworkPolicy", K8S_DIR / "networkpolicy.yaml"),
                                              id="NetworkPolicy")])
def test_manifest_validates_against_the_kubernetes_schema(doc: Any) -> None:
    manifest = doc()
    try:
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{manifest['kind']} {'.'.join(map(str, exc.path))}: {exc.message}")


def test_network_policy_lets_greenserve_reach_immichs_machine_learning() -> None:
    policy = one("NetworkPolicy", K8S_DIR / "networkpolicy.yaml")
    deployment = one("Deployment", ROOT / "deploy" / "k8s" / "deployment.yaml")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Egress"]
    (rule,) = policy["spec"]["egress"]
    assert [peer["podSelector"]["matchLabels"] for peer in rule["to"]] == [IMMICH_ML_LABELS]
    assert rule["ports"] == [{"port": IMMICH_ML_PORT, "protocol": "TCP"}]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kubectl_kustomize_builds_deploy_k8s_with_immichs_settings() -> None:
    r = subprocess.run(["kubectl", "kustomize", str(K8S_DIR)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    docs = [doc for doc in yaml.safe_load_all(r.stdout) if doc]
    assert sorted(d["metadata"]["name"] for d in docs if d["kind"] == "NetworkPolicy") == [
        "greenserve", "greenserve-immich-upstream"]
    (built,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert built["data"] == config_map()["data"]
