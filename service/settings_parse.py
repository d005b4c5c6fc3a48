"""Reading one GREENSERVE_* value: its text cast to the setting's kind, and the checks that need no other
setting (``settings`` holds the settings themselves)."""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit


class SettingsError(ValueError):
    """A GREENSERVE_* variable has a value the server cannot start with."""


def parse(name: str, raw: str, kind: str) -> Any:
    raw = raw.strip()
    try:
        if kind == "int":
            return int(raw.replace("_", ""))
        if kind == "float":
            return float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a {'whole number' if kind == 'int' else 'number'}") from None
    if kind == "bool":
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise SettingsError(f"{name}={raw!r} is not a boolean; use true or false")
    if kind == "list":
        return tuple(p.strip() for p in raw.split(",") if p.strip())
    return raw


def range_text(lo: float | None, hi: float | None) -> str:
    if hi is None:
        return f">= {lo}"
    return f"{lo}..{hi}"


def check_http_url(name: str, value: str) -> None:
    """Empty (unset), or an absolute http(s) URL."""
    parts = urlsplit(value)
    if value and (parts.scheme not in ("http", "https") or not parts.hostname):
        raise SettingsError(f"{name}={value!r} must be an absolute http(s) URL")


def check_allow_entry(entry: str) -> None:
    if "://" in entry:
        parts = urlsplit(entry)
        if parts.scheme in ("http", "https") and parts.hostname and parts.path in ("", "/"):
            return
    else:
        try:
            ipaddress.ip_network(entry, strict=False)
            return
        except ValueError:
            pass
    raise SettingsError(f"GREENSERVE_FETCH_ALLOW entry {entry!r} is neither an origin like "
                        "http://10.0.0.5:9000 nor a CIDR like 10.0.0.0/8")


def check_callers(sources: tuple[str, ...], known: tuple[str, ...], proxies: tuple[str, ...]) -> None:
    """GREENSERVE_CALLER_FROM names known sources, and trusts forwarded addresses only from named proxies."""
    unknown = sorted(set(sources) - set(known))
    if unknown or not sources:
        raise SettingsError(f"GREENSERVE_CALLER_FROM={','.join(sources)!r}: use one or more of {', '.join(known)}")
    for entry in proxies:
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise SettingsError(f"GREENSERVE_TRUSTED_PROXIES entry {entry!r} is not an address or a CIDR like "
                                "10.0.0.0/8") from None
    if "forwarded" in sources and not proxies:
        raise SettingsError("GREENSERVE_CALLER_FROM has forwarded, but GREENSERVE_TRUSTED_PROXIES is empty: name the "
                            "proxies whose X-Real-IP to believe (behind the shipped nginx: 127.0.0.1)")


def check_int8(value: str) -> None:
    """GREENSERVE_INT8: off, allow or a minimum cosine between 0 and 1."""
    try:
        ok = value in ("off", "allow") or 0 < float(value) < 1
    except ValueError:
        ok = False
    if not ok:
        raise SettingsError(f"GREENSERVE_INT8={value!r} is not off, allow or a minimum cosine between 0 and 1")
