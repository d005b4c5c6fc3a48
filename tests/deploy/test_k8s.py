"""deploy/k8s and deploy/kserve: every manifest against the Kubernetes 1.37 JSON schemas (kubernetes-validate,
strict: unknown fields fail), the InferenceService against kserve's own API models, and the invariants
that keep a pod alive, drained and boxed in: probes, grace period, resources, security, egress."""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from harness.launch import ROOT
from service.pipeline.ssrf import blocked_reason
from service.settings import Settings, env_name

K8S_VERSION = "1.37"  # the newest schema set kubernetes-validate 1.37 ships (it works offline)
K8S_DIR = ROOT / "deploy" / "k8s"
KSERVE_DIR = ROOT / "deploy" / "kserve"
NOT_APPLIED = {"kustomization.yaml", "secret.example.yaml"}  # the latter: no placeholder token in a cluster
# docs/BENCHMARKS.md, "Memory per worker" (resnet50): PSS total of the worst weights mode (plain state dict converted
# to channels_last) by worker count, and the queued photos of 8 albums on 2 workers (docs/SCHEDULING.md#fetch-pacing).
MEASURED_PSS_TOTAL_MB = {1: 754.4, 2: 1314.5, 4: 2515.0}
MEASURED_QUEUED_PHOTOS_MB = 733
HEALTHZ_P99_MAX_S = 0.041  # the worst /healthz p99 at saturation on 2 cores in docs/BENCHMARKS.md
SETTINGS = {env_name(f.name) for f in dataclasses.fields(Settings)}


def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def manifests() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(K8S_DIR.rglob("*.yaml")):
        if path.name != "kustomization.yaml":
            found += [(str(path.relative_to(ROOT)), doc) for doc in load(path)]
    return found


def one(kind: str, path: Path | None = None) -> dict[str, Any]:
    docs = [doc for doc in load(path) if doc["kind"] == kind] if path else [
        doc for name, doc in manifests() if doc["kind"] == kind and "/examples/" not in name]
    assert len(docs) == 1, f"expected one {kind}, found {len(docs)}"
    return docs[0]


def container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    (c,) = pod_spec["containers"]
    return c


def pod_spec() -> dict[str, Any]:
    return one("Deployment")["spec"]["template"]["spec"]


def port_number(c: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port, by number or by the container port's name."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in c["ports"] if p.get("name") == port]
    return number


def config_env() -> dict[str, str]:
    return one("ConfigMap", K8S_DIR / "configmap.yaml")["data"]


def literal_env(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def pod_env() -> dict[str, str]:
    """What the container sees: the ConfigMap (envFrom), then its own literal env on top."""
    return {**config_env(), **literal_env(container(pod_spec()))}


def quantity(text: str | int) -> float:
    """A Kubernetes quantity (2, 500m, 3Gi, 1G) as a plain number."""
    m = re.fullmatch(r"([0-9.]+)(m|k|M|G|T|Ki|Mi|Gi|Ti)?", str(text))
    assert m, text
    scale = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[m.group(2)]
    return float(m.group(1)) * scale


def prestop_sleep_s(c: dict[str, Any]) -> int:
    hook = c["lifecycle"]["preStop"]
    if "sleep" in hook:  # the kubelet's own sleep action
        return int(hook["sleep"]["seconds"])
    command = hook["exec"]["command"]
    assert command[0] == "sleep", command
    return int(command[1])


# ------------------------------------------------------------------ schemas


@pytest.mark.parametrize(("name", "doc"), manifests(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_manifest_validates_against_the_kubernetes_schema(name: str, doc: dict[str, Any]) -> None:
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{name}: {doc['kind']} {'.'.join(map(str, exc.path))}: {exc.message}")


def test_a_typo_fails_schema_validation() -> None:
    """The strict schemas reject unknown fields: the validation above is not a no-op."""
    deployment = one("Deployment")
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_kustomization_applies_every_manifest_but_the_examples() -> None:
    (kustomization,) = load(K8S_DIR / "kustomization.yaml")
    listed = kustomization["resources"]
    on_disk = sorted(p.name for p in K8S_DIR.glob("*.yaml") if p.name not in NOT_APPLIED)
    assert sorted(listed) == on_disk
    assert len(listed) == len(set(listed))


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kubectl_kustomize_builds_the_manifests() -> None:
    r = subprocess.run(["kubectl", "kustomize", str(K8S_DIR)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    kinds = sorted(doc["kind"] for doc in yaml.safe_load_all(r.stdout) if doc)
    assert kinds == ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "NetworkPolicy",
                     "PersistentVolumeClaim", "PodDisruptionBudget", "Service"]


# ------------------------------------------------------------------ the pod


def test_probes_hit_readyz_and_healthz_on_the_container_port() -> None:
    c = container(pod_spec())
    bind_port = int(pod_env()["GREENSERVE_BIND"].rsplit(":", 1)[1])
    assert pod_env()["GREENSERVE_BIND"].startswith("0.0.0.0:")  # the image's 127.0.0.1 default is unreachable
    for probe, path in (("startupProbe", "/readyz"), ("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = c[probe]["httpGet"]
        assert get["path"] == path, probe
        assert port_number(c, get["port"]) == bind_port, probe


def test_startup_probe_leaves_minutes_for_the_model_load() -> None:
    startup = container(pod_spec())["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 180  # the systemd unit's TimeoutStartSec


def test_liveness_timeout_is_far_above_the_measured_healthz_p99() -> None:
    liveness = container(pod_spec())["livenessProbe"]
    assert liveness["timeoutSeconds"] > 1
    assert liveness["timeoutSeconds"] >= 100 * HEALTHZ_P99_MAX_S
    assert liveness["failureThreshold"] * liveness["periodSeconds"] >= 30  # outlasts a worker respawn


def test_grace_period_covers_the_prestop_sleep_and_gunicorns_graceful_timeout() -> None:
    spec = pod_spec()
    graceful = Settings.from_env({k: v for k, v in pod_env().items() if k.startswith("GREENSERVE_")}).graceful_timeout_s
    assert graceful == int(config_env().get("GREENSERVE_GRACEFUL_TIMEOUT_S", Settings().graceful_timeout_s))
    sleep = prestop_sleep_s(container(spec))
    assert sleep >= 3  # endpoints need a few seconds to drop the pod
    assert spec["terminationGracePeriodSeconds"] >= sleep + graceful + 5


def test_pod_runs_as_a_fixed_non_root_user_without_privileges() -> None:
    spec = pod_spec()
    c = container(spec)
    pod_sc, sc = spec["securityContext"], c["securityContext"]
    assert pod_sc["runAsNonRoot"] is True and sc["runAsNonRoot"] is True
    assert pod_sc["runAsUser"] == sc["runAsUser"] and sc["runAsUser"] > 0
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    assert pod_sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"


def test_root_filesystem_is_read_only_with_an_empty_dir_for_tmp() -> None:
    """gunicorn.conf.py's on_starting makes the metrics directory with tempfile.mkdtemp(): /tmp must be writable."""
    spec = pod_spec()
    c = container(spec)
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    assert pod_env().get("TMPDIR", "/tmp") == "/tmp"
    for path, mount in mounts.items():  # anything writable is scratch space, never the weights
        if not mount.get("readOnly"):
            assert "emptyDir" in volumes[mount["name"]], path


def test_weights_come_from_a_read_only_volume_and_are_never_downloaded() -> None:
    spec = pod_spec()
    c = container(spec)
    env = pod_env()
    volumes = {v["name"]: v for v in spec["volumes"]}
    read_only = [m["mountPath"] for m in c["volumeMounts"]
                 if m.get("readOnly") and "emptyDir" not in volumes[m["name"]]]
    for cache in ("TORCH_HOME", "HF_HOME"):
        assert any(env[cache].startswith(path + "/") for path in read_only), cache
    assert env["HF_HUB_OFFLINE"] == "1"
    # `auto` would serve random weights when the cache is empty; a file must live on the volume.
    weights = env["GREENSERVE_WEIGHTS"]
    assert weights == "imagenet" or any(weights.startswith(path + "/") for path in read_only), weights
    assert "command" not in c and "args" not in c  # the image's entrypoint: gunicorn -c gunicorn.conf.py


def test_the_token_comes_from_an_optional_secret_never_the_config_map() -> None:
    c = container(pod_spec())
    (token,) = [e for e in c["env"] if e["name"] == "GREENSERVE_API_TOKEN"]
    ref = token["valueFrom"]["secretKeyRef"]
    assert ref["optional"] is True
    secret = one("Secret", K8S_DIR / "secret.example.yaml")
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
    assert "GREENSERVE_API_TOKEN" not in config_env()
    assert [r["configMapRef"]["name"] for r in c["envFrom"]] == [one("ConfigMap")["metadata"]["name"]]


def test_config_map_names_only_real_settings_and_the_server_accepts_them() -> None:
    env = pod_env()
    names = {k for k in env if k.startswith("GREENSERVE_")}
    assert names <= SETTINGS, sorted(names - SETTINGS)
    assert {"GREENSERVE_MODEL", "GREENSERVE_WEIGHTS", "GREENSERVE_WORKERS", "GREENSERVE_IMAGE_BASE_URL"} <= names
    Settings.from_env({k: env[k] for k in names})  # raises, naming the variable, on a bad value
    assert set(env) - names <= {"TORCH_HOME", "HF_HOME", "HF_HUB_OFFLINE", "TMPDIR", "XDG_CACHE_HOME"}


def test_thread_plan_fits_the_cpu_limit() -> None:
    """A container's affinity mask shows every node core, so the plan is stated: workers x threads <= CPUs."""
    settings = Settings.from_env({k: v for k, v in pod_env().items() if k.startswith("GREENSERVE_")})
    cpus = quantity(container(pod_spec())["resources"]["limits"]["cpu"])
    assert settings.torch_threads >= 1  # pinned, not derived from the node's cores
    assert settings.workers * settings.torch_threads <= cpus
    assert settings.decode_threads >= 1


def test_memory_is_sized_from_the_measured_pss() -> None:
    resources = container(pod_spec())["resources"]
    workers = int(pod_env()["GREENSERVE_WORKERS"])
    need = (MEASURED_PSS_TOTAL_MB[workers] + MEASURED_QUEUED_PHOTOS_MB) * 1e6
    assert quantity(resources["requests"]["memory"]) >= need
    assert quantity(resources["limits"]["memory"]) >= quantity(resources["requests"]["memory"])
    assert resources["limits"]["memory"] == resources["requests"]["memory"]  # Guaranteed QoS, no OOM surprise
    assert resources["limits"]["cpu"] == resources["requests"]["cpu"]


def test_metrics_are_scraped_from_the_container_port() -> None:
    template = one("Deployment")["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == port_number(container(template["spec"]), "http")


# ------------------------------------------------------------------ around the pod


def test_service_targets_the_container_port_of_the_pods() -> None:
    service, deployment = one("Service"), one("Deployment")
    (port,) = service["spec"]["ports"]
    assert service["spec"]["type"] == "ClusterIP"
    assert (port["name"], port["port"]) == ("http", 80)
    assert port_number(container(pod_spec()), port["targetPort"]) == 8000
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("path", [K8S_DIR / "hpa.yaml", K8S_DIR / "examples" / "hpa-queue.yaml"], ids=lambda p: p.name)
def test_hpa_targets_the_deployment(path: Path) -> None:
    hpa, deployment = one("HorizontalPodAutoscaler", path), one("Deployment")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]


def test_cpu_hpa_scales_on_cpu_utilisation() -> None:
    (metric,) = one("HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
    assert 0 < metric["resource"]["target"]["averageUtilization"] <= 90


def test_queue_hpa_and_adapter_rule_name_the_real_gauge() -> None:
    from service import metrics

    name = metrics.QUEUE_IMAGES._name
    assert (name, metrics.QUEUE_IMAGES._type) == ("greenserve_queue_images", "gauge")
    (metric,) = one("HorizontalPodAutoscaler", K8S_DIR / "examples" / "hpa-queue.yaml")["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == name
    per_pod = quantity(metric["pods"]["target"]["averageValue"])
    assert 0 < per_pod < int(pod_env()["GREENSERVE_WORKERS"]) * Settings().max_queue_images  # before the 503s
    adapter = one("ConfigMap", K8S_DIR / "examples" / "prometheus-adapter.yaml")
    (rule,) = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    assert rule["seriesQuery"].startswith(name + "{")
    assert rule["name"]["as"] == name
    assert "rate(" not in rule["metricsQuery"]  # a gauge, not a counter
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}


def test_pdb_keeps_pods_serving_during_drains() -> None:
    pdb = one("PodDisruptionBudget")
    labels = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] < one("HorizontalPodAutoscaler")["spec"]["minReplicas"]


# ------------------------------------------------------------------ egress: the SSRF guard's second layer


def egress_allows(policy: dict[str, Any], address: str, port: int) -> bool:
    """Whether any egress rule's ipBlock lets ``address``:``port`` (TCP) out."""
    ip = ipaddress.ip_address(address)
    for rule in policy["spec"]["egress"]:
        ports = rule.get("ports")
        if ports and not any(p.get("port") == port and p.get("protocol", "TCP") == "TCP" for p in ports):
            continue
        for peer in rule.get("to", []):
            block = peer.get("ipBlock")
            if block is None:
                continue
            cidr = ipaddress.ip_network(block["cidr"])
            if ip.version == cidr.version and ip in cidr and not any(
                    ip in ipaddress.ip_network(e) for e in block.get("except", [])):
                return True
    return False


NON_PUBLIC = ["10.0.0.1", "10.255.255.254", "172.16.0.1", "172.31.255.254", "192.168.0.1", "192.168.255.254",
              "100.64.0.1", "100.127.255.254", "169.254.169.254", "169.254.0.1", "127.0.0.1", "0.0.0.0",
              "fd00:ec2::254", "fc00::1", "fe80::1", "febf::1", "::1", "::ffff:10.0.0.1", "::ffff:169.254.169.254"]
PUBLIC = ["8.8.8.8", "1.1.1.1", "151.101.1.69", "2606:4700:4700::1111", "2a00:1450:4001:80b::200e"]


@pytest.mark.parametrize("address", NON_PUBLIC)
def test_network_policy_blocks_what_the_ssrf_guard_blocks(address: str) -> None:
    assert blocked_reason(ipaddress.ip_address(address)) is not None  # layer one (service/pipeline/ssrf.py)
    policy = one("NetworkPolicy")
    for port in (80, 443, 8080):
        assert not egress_allows(policy, address, port), f"{address}:{port}"


@pytest.mark.parametrize("address", PUBLIC)
def test_network_policy_lets_image_fetches_reach_the_internet(address: str) -> None:
    assert blocked_reason(ipaddress.ip_address(address)) is None
    policy = one("NetworkPolicy")
    assert egress_allows(policy, address, 443) and egress_allows(policy, address, 80)


def test_network_policy_excepts_the_private_ranges_by_name() -> None:
    blocks = [peer["ipBlock"] for rule in one("NetworkPolicy")["spec"]["egress"] for peer in rule.get("to", [])
              if "ipBlock" in peer]
    excepted = {e for b in blocks for e in b.get("except", [])}
    assert {"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16", "127.0.0.0/8",
            "fc00::/7", "fe80::/10"} <= excepted
    for b in blocks:  # the API server rejects an except outside its cidr
        assert all(ipaddress.ip_network(e).subnet_of(ipaddress.ip_network(b["cidr"])) for e in b.get("except", []))


def test_network_policy_admits_the_container_port_and_allows_dns() -> None:
    policy = one("NetworkPolicy")
    labels = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    (ingress,) = policy["spec"]["ingress"]
    assert [p["port"] for p in ingress["ports"]] == [port_number(container(pod_spec()), "http")]
    dns = [r for r in policy["spec"]["egress"] if any(p["port"] == 53 for p in r.get("ports", []))]
    assert dns and {p["protocol"] for r in dns for p in r["ports"]} == {"UDP", "TCP"}
    assert all("ipBlock" not in peer for r in dns for peer in r["to"])  # the cluster's resolver, not the world


# ------------------------------------------------------------------ KServe


def kserve_check(value: Any, type_name: str, where: str) -> list[str]:
    """Problems of ``value`` against kserve's generated API model ``type_name`` (the CRD's OpenAPI types):
    unknown fields, wrong primitive types, recursively. Types the models do not know fail too."""
    import kserve.models
    import kubernetes.client.models

    if m := re.fullmatch(r"(?:list|List)\[(.+)\]", type_name):
        if not isinstance(value, list):
            return [f"{where}: expected a list"]
        return [p for i, item in enumerate(value) for p in kserve_check(item, m.group(1), f"{where}[{i}]")]
    if m := re.fullmatch(r"dict\(str, (.+)\)|Dict\[str, (.+)\]", type_name):
        if not isinstance(value, dict):
            return [f"{where}: expected a map"]
        inner = m.group(1) or m.group(2)
        return [p for k, v in value.items() for p in kserve_check(v, inner, f"{where}.{k}")]
    primitives = {"str": (str,), "int": (int,), "bool": (bool,), "float": (int, float), "object": (object,),
                  "ResourceQuantity": (str, int, float)}
    if type_name in primitives:
        ok = isinstance(value, primitives[type_name]) and not (type_name == "int" and isinstance(value, bool))
        return [] if ok else [f"{where}: {value!r} is not {type_name}"]
    model = getattr(kserve.models, type_name, None) or getattr(kubernetes.client.models, type_name, None)
    if model is None:
        return [f"{where}: kserve knows no type {type_name}"]
    if not isinstance(value, dict):
        return [f"{where}: expected a {type_name} object"]
    by_key = {key: attr for attr, key in model.attribute_map.items()}
    problems = [f"{where}.{k}: not a field of {type_name}" for k in value if k not in by_key]
    return problems + [p for k, v in value.items() if k in by_key
                       for p in kserve_check(v, model.openapi_types[by_key[k]], f"{where}.{k}")]


def inference_service() -> dict[str, Any]:
    return one("InferenceService", KSERVE_DIR / "inferenceservice.yaml")


def test_inference_service_matches_kserves_api_models() -> None:
    isvc = inference_service()
    assert (isvc["apiVersion"], isvc["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    assert kserve_check(isvc, "V1beta1InferenceService", "isvc") == []


def test_kserve_check_catches_a_typo() -> None:
    isvc = inference_service()
    broken = {**isvc, "spec": {"predictor": {**isvc["spec"]["predictor"], "minReplica": 1}}}
    assert kserve_check(broken, "V1beta1InferenceService", "isvc") == [
        "isvc.spec.predictor.minReplica: not a field of V1beta1PredictorSpec"]


def test_inference_service_pod_validates_against_the_kubernetes_pod_schema() -> None:
    """The predictor is a PodSpec plus KServe's component fields: the PodSpec part must be a valid pod."""
    import kserve.models

    predictor = dict(inference_service()["spec"]["predictor"])
    component = {v for k, v in kserve.models.V1beta1ComponentExtensionSpec.attribute_map.items()}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "predictor"},
           "spec": {k: v for k, v in predictor.items() if k not in component}}
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_inference_service_runs_the_same_server_speaking_v2() -> None:
    """KServe routes /v2/... to the predictor; greenserve's OIP v2 routes answer. PROTOCOL is how a custom
    predictor declares it (protocolVersion is a field of predictor.model, for serving runtimes only)."""
    isvc = inference_service()
    predictor = isvc["spec"]["predictor"]
    (c,) = predictor["containers"]
    deployment_c = container(pod_spec())
    assert c["name"] == "kserve-container"
    assert c["image"] == deployment_c["image"] and "command" not in c and "args" not in c
    env = literal_env(c)
    assert env["PROTOCOL"] == "v2"
    (port,) = c["ports"]
    assert port == {"name": "http1", "containerPort": 8000, "protocol": "TCP"}  # h2c would mean gRPC
    assert env["GREENSERVE_BIND"] == f"0.0.0.0:{port['containerPort']}"
    names = {k for k in env if k.startswith("GREENSERVE_")}
    assert names <= SETTINGS, sorted(names - SETTINGS)
    Settings.from_env({k: env[k] for k in names})
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # same timings, paths, port number
        ours, theirs = c[probe], deployment_c[probe]
        assert port_number(c, ours["httpGet"]["port"]) == port_number(deployment_c, theirs["httpGet"]["port"])
        strip = {**ours, "httpGet": {**ours["httpGet"], "port": None}}
        assert strip == {**theirs, "httpGet": {**theirs["httpGet"], "port": None}}, probe
    assert c["resources"] == deployment_c["resources"]
    assert c["securityContext"] == deployment_c["securityContext"]
    assert predictor["terminationGracePeriodSeconds"] >= prestop_sleep_s(c) + Settings.from_env(
        {k: env[k] for k in names}).graceful_timeout_s + 5
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in predictor["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] in ("Standard", "RawDeployment")
