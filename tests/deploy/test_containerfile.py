"""The Containerfile, read statically: multi-stage, the Makefile's torch pins, a fixed non-root uid that
deploy/k8s names too, no download at start, HEALTHCHECK on /healthz, gunicorn as the entrypoint. Building
it needs a container engine and the network (deploy/README.md, "The container image", says how it was verified)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.launch import ROOT

CONTAINERFILE = ROOT / "Containerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        pending += " " + stripped.removesuffix("\\").strip() if pending else stripped.removesuffix("\\").strip()
        if not stripped.endswith("\\"):
            word, _, rest = pending.partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


INSTRUCTIONS = instructions(CONTAINERFILE.read_text())


def stages() -> list[tuple[str, list[tuple[str, str]]]]:
    """(stage name, its instructions) in order; the last one is the image that runs."""
    found: list[tuple[str, list[tuple[str, str]]]] = []
    for word, rest in INSTRUCTIONS:
        if word == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, flags=re.I)
            assert m, rest
            found.append((m.group(2) or m.group(1), []))
        elif found:
            found[-1][1].append((word, rest))
    return found


def runtime() -> list[tuple[str, str]]:
    return stages()[-1][1]


def args_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    out = {}
    for word, rest in [("ARG", r) for w, r in INSTRUCTIONS if w == "ARG"] + stage:
        if word == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            out[name] = default.strip('"')
    return out


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env = {}
    for word, rest in stage:
        if word == "ENV":
            for pair in shlex.split(rest):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


def exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list), f"not the exec (JSON) form: {rest}"
    return value


def makefile_torch_pins() -> list[str]:
    m = re.search(r"^TORCH_PINS\s*:?=\s*(.+)$", (ROOT / "Makefile").read_text(), flags=re.M)
    assert m, "TORCH_PINS not found in the Makefile"
    return m.group(1).split()


def test_is_multi_stage_and_the_runtime_copies_the_builders_venv() -> None:
    names = [name for name, _ in stages()]
    assert names[0] == "builder" and len(names) >= 2
    copies = [rest for word, rest in runtime() if word == "COPY"]
    assert "--from=builder /opt/venv /opt/venv" in copies
    assert not any(word == "RUN" and "pip" in rest for word, rest in runtime())  # nothing built in the runtime


def test_builder_installs_the_makefiles_torch_pins_then_the_package() -> None:
    (_, builder), *_ = stages()
    pip_runs = [rest for word, rest in builder if word == "RUN" and "pip install" in rest]
    torch_line = next(r for r in pip_runs if "torch==" in r)
    pins = re.findall(r"\b(torch(?:vision)?==\S+)", torch_line)
    assert pins == makefile_torch_pins()
    assert '--index-url "${TORCH_INDEX_URL}"' in torch_line
    assert pip_runs.index(torch_line) < next(i for i, r in enumerate(pip_runs) if re.search(r"pip install \.(\s|$)", r))
    assert not any("-e " in r or "--editable" in r for r in pip_runs)


def test_cpu_torch_by_default_and_a_build_arg_for_cuda() -> None:
    assert args_of(stages()[0][1])["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert "--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu" in CONTAINERFILE.read_text()
    assert INSTRUCTIONS[0][0] == "ARG" and INSTRUCTIONS[0][1].startswith("BASE_IMAGE=")
    assert all(rest.split()[0] in ("${BASE_IMAGE}",) for word, rest in INSTRUCTIONS if word == "FROM")


def test_runs_as_the_fixed_non_root_uid_that_kubernetes_names() -> None:
    uid = int(args_of(runtime())["UID"])
    assert uid >= 1000
    (user,) = [rest for word, rest in runtime() if word == "USER"]
    assert user.replace("${UID}", str(uid)) == f"{uid}:{uid}"  # numeric: runAsNonRoot can check it
    assert any("--uid ${UID}" in rest for word, rest in runtime() if word == "RUN")
    for path in (ROOT / "deploy" / "k8s" / "deployment.yaml", ROOT / "deploy" / "kserve" / "inferenceservice.yaml"):
        text = path.read_text()
        uids = {int(u) for u in re.findall(r"(?:runAsUser|runAsGroup|fsGroup):\s*(\d+)", text)}
        assert uids == {uid}, path.name
    (deployment,) = yaml.safe_load_all((ROOT / "deploy" / "k8s" / "deployment.yaml").read_text())
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == uid


def test_weights_are_mounted_or_baked_never_downloaded_at_start() -> None:
    env = env_of(runtime())
    assert env["TORCH_HOME"].startswith("/models/") and env["HF_HOME"].startswith("/models/")
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["GREENSERVE_WEIGHTS"] == "${WEIGHTS:+/models/}${WEIGHTS:-auto}"  # the baked file, else auto
    assert "--from=weights /models /models" in [rest for word, rest in runtime() if word == "COPY"]
    everything = " ".join(rest for _, rest in runtime())
    assert "download-weights" not in everything and "curl" not in everything and "wget" not in everything


def test_the_server_listens_on_all_interfaces_port_8000() -> None:
    env = env_of(runtime())
    assert env["GREENSERVE_BIND"] == "0.0.0.0:8000"
    assert [rest for word, rest in runtime() if word == "EXPOSE"] == ["8000"]
    assert env["TMPDIR"] == "/tmp"  # gunicorn.conf.py's mkdtemp, under the k8s emptyDir


def test_healthcheck_gets_healthz_with_python_only() -> None:
    (check,) = [rest for word, rest in runtime() if word == "HEALTHCHECK"]
    options, _, command = check.partition(" CMD ")
    argv = exec_form(command)
    assert argv[:2] == ["python3", "-c"]
    assert "urllib.request" in argv[2] and "http://127.0.0.1:8000/healthz" in argv[2]
    start = re.search(r"--start-period=(\d+)s", options)
    assert start and int(start.group(1)) >= 180  # a worker accepts nothing until its model is loaded


def test_healthcheck_command_is_valid_python() -> None:
    (check,) = [rest for word, rest in runtime() if word == "HEALTHCHECK"]
    code = exec_form(check.partition(" CMD ")[2])[2]
    compile(code, "HEALTHCHECK", "exec")
    # and it fails (non-zero) when nothing listens, as Docker needs
    r = subprocess.run([sys.executable, "-c", code.replace("127.0.0.1:8000", "127.0.0.1:9")],
                       capture_output=True, timeout=30)
    assert r.returncode != 0


def test_entrypoint_is_gunicorn_with_the_repos_config() -> None:
    (entrypoint,) = [rest for word, rest in runtime() if word == "ENTRYPOINT"]
    assert exec_form(entrypoint) == ["gunicorn", "-c", "gunicorn.conf.py", "wsgi:app"]
    assert not [rest for word, rest in runtime() if word == "CMD"]
    (workdir,) = [rest for word, rest in runtime() if word == "WORKDIR"]
    copies = [rest for word, rest in runtime() if word == "COPY"]
    assert "gunicorn.conf.py wsgi.py ./" in copies and workdir == "/app"
    assert "/opt/venv/bin" in env_of(runtime())["PATH"].split(":")[0]


def test_build_context_holds_what_the_recipe_copies() -> None:
    """.dockerignore (read by podman too) keeps .venv and .git out; every COPY source must stay in."""
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*"  # everything out, then only what is named back in
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    sources = set()
    for word, rest in INSTRUCTIONS:
        if word == "COPY" and "--from=" not in rest:
            sources.update(s.rstrip("/") for s in rest.split()[:-1] if not s.startswith("--"))
    sources.discard(".")
    assert sources <= allowed, sorted(sources - allowed)
    assert "weights" in allowed
    for path in sources:
        assert (ROOT / path).exists(), path


@pytest.mark.parametrize("name", ["README.md", "setup.cfg", "setup.py"])
def test_package_metadata_is_copied_before_pip_install(name: str) -> None:
    """setup.cfg reads README.md (long_description = file:), so the build needs all three."""
    (_, builder), *_ = stages()
    copy_at = next(i for i, (w, r) in enumerate(builder) if w == "COPY" and name in r.split())
    install_at = next(i for i, (w, r) in enumerate(builder) if w == "RUN" and re.search(r"pip install \.", r))
    assert copy_at < install_at
    assert Path(ROOT / name).exists()
