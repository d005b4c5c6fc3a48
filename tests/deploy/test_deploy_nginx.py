"""The nginx config and the templated unit, checked statically: their values nest around greenserve's settings,
``nginx -t`` accepts the shipped config as the e2e tests render it (``harness.deploy.render``: only addresses and
paths change), ``systemd-analyze verify`` the unit's instances."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.deploy import (
    CONF,
    INSTALL_DIR,
    SHIPPED_UPSTREAMS,
    UNIT,
    conf_value,
    conf_values,
    directives,
    render,
    seconds,
    size_bytes,
)
from harness.launch import ROOT
from harness.nginx import nginx_binary, nginx_command
from service.settings import Settings

TEMPLATE = ROOT / "deploy" / "greenserve@.service"


def test_nginx_values_nest_around_greenserves_settings() -> None:
    defaults = Settings()
    read_timeouts = {seconds(v) for v in conf_values("proxy_read_timeout")}
    main_read = seconds(re.search(r"location / \{[^}]*proxy_read_timeout\s+(\w+);", CONF.read_text()).group(1))
    assert defaults.request_timeout_s < main_read < defaults.worker_timeout_s
    assert max(read_timeouts) == main_read  # /healthz may only be shorter
    assert seconds(conf_value("keepalive_timeout")) < defaults.keepalive_s
    assert size_bytes(conf_value("client_max_body_size")) == defaults.max_body_bytes


def test_nginx_retries_elsewhere_on_errors_502_and_503_within_bounds() -> None:
    assert set(conf_value("proxy_next_upstream").split()) == {"error", "timeout", "http_502", "http_503",
                                                             "non_idempotent"}
    assert 2 <= int(conf_value("proxy_next_upstream_tries")) <= 5
    assert 0 < seconds(conf_value("proxy_next_upstream_timeout")) < Settings().request_timeout_s
    assert conf_values("least_conn") == [""]


def test_nginx_keeps_upstream_connections_alive_and_buffers_bodies() -> None:
    assert int(conf_value("keepalive")) > 0
    assert conf_value("proxy_http_version") == "1.1"
    headers = {v.split(None, 1)[0]: v.split(None, 1)[1] for v in conf_values("proxy_set_header")}
    assert headers["Connection"] == '""'
    assert headers["X-Request-ID"] == "$greenserve_request_id"
    assert headers["X-Forwarded-For"] == "$proxy_add_x_forwarded_for" and headers["X-Real-IP"] == "$remote_addr"
    assert conf_value("proxy_request_buffering") == "on"
    assert size_bytes(conf_value("client_body_buffer_size")) >= 64 * 1024


@pytest.mark.skipif(nginx_binary() is None, reason="nginx not installed (make test installs it as root)")
def test_nginx_accepts_the_shipped_config(tmp_path: Path) -> None:
    r = subprocess.run([*nginx_command(render(tmp_path)), "-t"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "[warn]" not in r.stderr and "[emerg]" not in r.stderr, r.stderr


def rendered_template(tmp_path: Path) -> Path:
    out = tmp_path / TEMPLATE.name
    out.write_text(TEMPLATE.read_text().replace(INSTALL_DIR, str(ROOT)))
    return out


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("port", SHIPPED_UPSTREAMS)
def test_systemd_analyze_verify_passes_for_each_instance(tmp_path: Path, port: int) -> None:
    template = rendered_template(tmp_path)
    # an instance's path next to its template: systemd-analyze instantiates the template for it
    r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / f"greenserve@{port}.service")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "greenserve@" not in r.stderr, r.stderr
    argv = shlex.split(directives(template)["ExecStart"][0])
    assert Path(argv[2]).is_file(), f"{argv[2]} (run by env, so verify does not check it) does not exist"


def test_template_keeps_the_single_units_contract_and_hardening() -> None:
    single, template = directives(UNIT), directives(TEMPLATE)
    per_instance = {"Description", "EnvironmentFile", "RuntimeDirectory", "ExecStart"}
    for key in single.keys() - per_instance:
        assert template.get(key) == single[key], key
    assert template.keys() - single.keys() == set()
    assert template["EnvironmentFile"] == single["EnvironmentFile"] + ["-/etc/greenserve/%i.env"]
    assert template["RuntimeDirectory"] == ["greenserve/%i"]  # systemd removes it when its own unit stops
    assert template["ExecStart"][0].endswith(single["ExecStart"][0])


def test_the_instance_name_is_the_bind_whatever_the_shared_env_says() -> None:
    """The env files override Environment= lines, so the bind comes from the command line; checked by running
    the unit's ExecStart for greenserve@8001 up to gunicorn.conf.py with the shared file's GREENSERVE_BIND."""
    argv = shlex.split(directives(TEMPLATE)["ExecStart"][0].replace("%i", "8001"))
    env_part = argv[:argv.index(next(a for a in argv if a.endswith("/gunicorn")))]
    code = "import runpy; print(runpy.run_path('gunicorn.conf.py')['bind'])"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GREENSERVE_")}
    env["GREENSERVE_BIND"] = "127.0.0.1:8000"  # what deploy/greenserve.env sets for the single unit
    r = subprocess.run([*env_part, sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "127.0.0.1:8001"
