"""The shipped deploy/ artefacts as the tests read them: the systemd units' directives, the nginx config's values,
and that config rendered to run on 127.0.0.1 (only its addresses and paths change)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from harness.launch import ROOT

UNIT = ROOT / "deploy" / "greenserve.service"
INSTALL_DIR = "/opt/greenserve"
CONF = ROOT / "deploy" / "nginx" / "greenserve.conf"
SHIPPED_UPSTREAMS = (8001, 8002)  # the instances the shipped config names: greenserve@8001, greenserve@8002
_SIZE_UNITS = {"": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}
_TIME_UNITS = {"ms": 0.001, "s": 1, "m": 60}


def directives(unit: Path) -> dict[str, list[str]]:
    """A unit file's ``Key=value`` lines: each key's values, in order."""
    found: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        m = re.match(r"^(\w+)=(.*)$", line.strip())
        if m:
            found.setdefault(m.group(1), []).append(m.group(2))
    return found


def _swap(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"expected one {old!r} in {CONF.name}: the rendering no longer fits the file"
    return text.replace(old, new)


def render(prefix: Path, *, listen: str | None = None, upstreams: Sequence[int] | None = None) -> Path:
    """nginx.conf in ``prefix`` that includes the shipped config with only its listen address, upstream ports and
    log directory changed, and with pid, logs and temp files inside ``prefix``. Returns the nginx.conf."""
    text = _swap(CONF.read_text(), "/var/log/nginx/", f"{prefix}/logs/")
    if listen is not None:
        text = _swap(text, "listen 80 default_server;", f"listen {listen};")
    for shipped, port in zip(SHIPPED_UPSTREAMS, upstreams or (), strict=False):
        text = _swap(text, f"server 127.0.0.1:{shipped} ", f"server 127.0.0.1:{port} ")
    for sub in ("logs", "temp"):
        (prefix / sub).mkdir(parents=True, exist_ok=True)
    (prefix / "greenserve.conf").write_text(text)
    temp_paths = "".join(f"    {kind}_temp_path {prefix}/temp/{kind};\n"
                         for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    # As root, nginx's workers would run as nobody and could not write bodies into pytest's 0700 directory.
    user = "user root;\n" if os.geteuid() == 0 else ""
    main = prefix / "nginx.conf"
    main.write_text(f"{user}worker_processes 1;\npid {prefix}/nginx.pid;\nerror_log {prefix}/logs/error.log info;\n"
                    f"events {{ worker_connections 512; }}\nhttp {{\n{temp_paths}"
                    f"    access_log {prefix}/logs/access.log;\n    include {prefix}/greenserve.conf;\n}}\n")
    return main


def conf_values(name: str) -> list[str]:
    """Every value of directive ``name`` in the shipped config, comments left out."""
    text = re.sub(r"#.*", "", CONF.read_text())
    return [(m.group(1) or "").strip() for m in re.finditer(rf"^\s*{name}(?:\s+([^;]*))?;", text, re.M)]


def conf_value(name: str) -> str:
    values = conf_values(name)
    assert len(values) == 1, f"{name}: {values}"
    return values[0]


def size_bytes(value: str) -> int:
    m = re.fullmatch(r"(\d+)([kmg]?)", value.lower())
    assert m, value
    return int(m.group(1)) * _SIZE_UNITS[m.group(2)]


def seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+)(ms|s|m)?", value)
    assert m, value
    return int(m.group(1)) * _TIME_UNITS[m.group(2) or "s"]
