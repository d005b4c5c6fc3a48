"""One request's own facts, built once when it starts and passed down: the data plane, the pipeline and the
engine take this value (or what it says) as an argument; nothing below the routes reads ``flask.g``."""

from __future__ import annotations

import hashlib
import ipaddress
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from service.errors import RequestError

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Identities:
    """Which identities the server believes (GREENSERVE_CALLER_FROM): a token it knows (GREENSERVE_API_TOKEN),
    a proxy's word for the client's address (GREENSERVE_TRUSTED_PROXIES only), the peer's address; and, when
    listed, a self-declared X-Client-ID inside the one of these the request has. A header anyone can send never
    names a caller on its own: rotating it would buy shares, borrowing another's would take theirs."""

    sources: tuple[str, ...] = ("token", "address")
    tokens: frozenset[str] = frozenset()  # digests of the tokens the server knows
    proxies: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    @classmethod
    def of(cls, sources: Sequence[str], api_token: str = "", trusted_proxies: Sequence[str] = ()) -> Identities:
        return cls(tuple(sources), frozenset(_digest(t.strip()) for t in api_token.split(",") if t.strip()),
                   tuple(ipaddress.ip_network(p, strict=False) for p in trusted_proxies))

    def proxied(self, remote_addr: str | None) -> bool:
        try:
            peer = ipaddress.ip_address(remote_addr or "")
        except ValueError:
            return False
        return any(peer in net for net in self.proxies)


def caller_of(headers: Mapping[str, str], remote_addr: str | None, who: Identities) -> tuple[str, str]:
    """(source, caller): the first identity of ``who.sources`` the request has, with its X-Client-ID inside it
    when ``header`` is listed. Tokens and ids are kept only as digests."""
    source, caller = "none", ""
    for name in who.sources:
        if name == "token":
            scheme, _, token = headers.get("Authorization", "").strip().partition(" ")
            if scheme.lower() == "bearer" and (digest := _digest(token.strip())) in who.tokens:
                source, caller = name, "token:" + digest
        elif name == "forwarded" and who.proxied(remote_addr):
            ip = headers.get("X-Real-IP", "").strip() or headers.get("X-Forwarded-For", "").split(",")[-1].strip()
            if ip:
                source, caller = name, "ip:" + ip[:64]
        elif name == "address" and remote_addr:
            source, caller = name, "ip:" + remote_addr
        if caller:
            break
    client_id = headers.get("X-Client-ID", "").strip()
    if "header" in who.sources and client_id:
        return "header", f"{caller}/client:{_digest(client_id)}"
    return source, caller


_URGENCY_RE = re.compile(r"(?:^|,)\s*u=([0-7])\s*(?:[,;]|$)")


def _urgency(priority: str) -> int:
    """The ``u`` member of an RFC 9218 Priority header; 3 (its default) when absent or malformed."""
    m = _URGENCY_RE.search(priority)
    return int(m.group(1)) if m else 3


@dataclass(frozen=True)
class RequestContext:
    request_id: str  # the caller's X-Request-ID when it is a sane one, else a fresh one
    started: float  # time.monotonic() when the app got the request
    timeout_header: str | None = None  # X-Request-Timeout as sent (checked only where a deadline is needed)
    client: Any = field(default=None, repr=False)  # the client's socket (gunicorn's), to see it leave
    caller: str = ""  # who is asking, for fair sharing (``caller_of``): never logged, never a metric label
    caller_source: str = ""  # how the caller was told apart: token, header, forwarded, address
    cache_control: str = ""  # the request's Cache-Control: no-cache (embed again) or no-store (no cache at all)
    urgency: int = 3  # RFC 9218's Priority header (u=0..7; 3 when absent): 4-7 ask to be a backfill

    @classmethod
    def begin(cls, headers: Mapping[str, str], client: Any, now: float, *, remote_addr: str | None = None,
              who: Identities = Identities()) -> RequestContext:
        """From the request's headers (X-Request-ID, X-Request-Timeout, what tells its caller) and its socket."""
        rid = headers.get("X-Request-ID", "")
        source, caller = caller_of(headers, remote_addr, who)
        return cls(rid if _REQUEST_ID_RE.match(rid) else uuid.uuid4().hex, now, headers.get("X-Request-Timeout"),
                   client, caller, source, headers.get("Cache-Control", "").lower(),
                   _urgency(headers.get("Priority", "")))

    def deadline(self, request_timeout_s: float, protocol_timeout_s: float | None = None) -> float:
        """GREENSERVE_REQUEST_TIMEOUT_S from the start, shortened by X-Request-Timeout or by the protocol's
        own timeout (OIP's ``timeout`` parameter)."""
        timeout = request_timeout_s
        if self.timeout_header:
            try:
                asked = float(self.timeout_header)
            except ValueError:
                raise RequestError(f"X-Request-Timeout={self.timeout_header!r} is not a number of seconds") from None
            if not asked > 0:
                raise RequestError("X-Request-Timeout must be a positive number of seconds")
            timeout = min(timeout, asked)
        if protocol_timeout_s is not None:
            timeout = min(timeout, protocol_timeout_s)
        return self.started + timeout
