"""One request's own facts, built once when it starts and passed down: the data plane, the pipeline and the
engine take this value (or what it says) as an argument; nothing below the routes reads ``flask.g``."""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from service.errors import RequestError

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_MAX_CLIENT_ID = 128


def caller_of(headers: Mapping[str, str], remote_addr: str | None, sources: Sequence[str]) -> tuple[str, str]:
    """(source, caller) from the first of ``sources`` the request has. A token is kept only as a digest."""
    for source in sources:
        if source == "token":
            scheme, _, token = headers.get("Authorization", "").strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return source, "token:" + hashlib.sha256(token.strip().encode()).hexdigest()[:24]
        elif source == "header":
            client_id = headers.get("X-Client-ID", "").strip()[:_MAX_CLIENT_ID]
            if client_id:
                return source, "client:" + client_id
        elif source == "forwarded":
            ip = headers.get("X-Real-IP", "").strip() or headers.get("X-Forwarded-For", "").split(",")[0].strip()
            if ip:
                return source, "ip:" + ip[:_MAX_CLIENT_ID]
        elif source == "address" and remote_addr:
            return source, "ip:" + remote_addr
    return "none", ""


@dataclass(frozen=True)
class RequestContext:
    request_id: str  # the caller's X-Request-ID when it is a sane one, else a fresh one
    started: float  # time.monotonic() when the app got the request
    timeout_header: str | None = None  # X-Request-Timeout as sent (checked only where a deadline is needed)
    client: Any = field(default=None, repr=False)  # the client's socket (gunicorn's), to see it leave
    caller: str = ""  # who is asking, for fair sharing (``caller_of``): never logged, never a metric label
    caller_source: str = ""  # how the caller was told apart: token, header, forwarded, address
    cache_control: str = ""  # the request's Cache-Control: no-cache (embed again) or no-store (no cache at all)

    @classmethod
    def begin(cls, headers: Mapping[str, str], client: Any, now: float, *, remote_addr: str | None = None,
              caller_from: Sequence[str] = ()) -> RequestContext:
        """From the request's headers (X-Request-ID, X-Request-Timeout, what tells its caller) and its socket."""
        rid = headers.get("X-Request-ID", "")
        source, caller = caller_of(headers, remote_addr, caller_from)
        return cls(rid if _REQUEST_ID_RE.match(rid) else uuid.uuid4().hex, now, headers.get("X-Request-Timeout"),
                   client, caller, source, headers.get("Cache-Control", "").lower())

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
