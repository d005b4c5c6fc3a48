"""immich's own ML service as an upstream: ``POST /predict`` forwards the tasks greenserve does not run (faces,
OCR) there as they came, the same body and Content-Type, and answers with what it answered: status, body and
Content-Type, byte for byte.

The URL is the operator's (``GREENSERVE_IMMICH_UPSTREAM``), never a caller's, so the image fetcher's address
guard (``pipeline/ssrf.py``) does not apply: a private address is what such a service has. The bounds are the
fetcher's: a connect timeout (``GREENSERVE_FETCH_CONNECT_TIMEOUT_S``), the whole exchange within the request's
deadline (a ``gevent.Timeout``: requests' own timeouts are per socket read), an answer of at most
``GREENSERVE_MAX_BODY_BYTES``; no redirects, no retries (a face detection is not worth running twice), no proxy
or netrc from the environment. The connections are gevent's sockets and kept alive (one ``requests.Session``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urljoin

import gevent
import requests
from urllib3.exceptions import HTTPError as Urllib3Error
from urllib3.exceptions import ReadTimeoutError

from service.errors import DeadlineExceeded, UpstreamFailed
from service.pipeline.fetch_body import reason
from service.settings import Settings

USER_AGENT = "greenserve/0.1 (+immich upstream)"
CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True)
class Forwarded:
    """The upstream's answer, as it sent it."""

    status: int
    body: bytes
    content_type: str


class Upstream(Protocol):
    def forward(self, path: str, body: bytes, content_type: str, *, deadline: float, request_id: str) -> Forwarded: ...


class HttpUpstream:
    def __init__(self, base_url: str, *, connect_timeout_s: float, max_answer_bytes: int,
                 session: requests.Session | None = None) -> None:
        self.base_url = base_url if base_url.endswith("/") else base_url + "/"
        self.connect_timeout_s = connect_timeout_s
        self.max_answer_bytes = max_answer_bytes
        self.session = session or requests.Session()
        self.session.trust_env = False  # a proxy or netrc from the environment must not silently route it
        self.session.headers.update({"User-Agent": USER_AGENT, "Accept-Encoding": "identity"})  # relayed as is

    @classmethod
    def from_settings(cls, settings: Settings) -> HttpUpstream | None:
        if not settings.immich_upstream:
            return None
        return cls(settings.immich_upstream, connect_timeout_s=settings.fetch_connect_timeout_s,
                   max_answer_bytes=settings.max_body_bytes)

    def close(self) -> None:
        self.session.close()

    def forward(self, path: str, body: bytes, content_type: str, *, deadline: float, request_id: str) -> Forwarded:
        url = urljoin(self.base_url, path.lstrip("/"))
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("the request's deadline passed before it could be forwarded to "
                                   "GREENSERVE_IMMICH_UPSTREAM", code="upstream_timeout")
        with gevent.Timeout(left) as timer:
            try:
                return self._exchange(url, body, content_type, left, request_id)
            except gevent.Timeout as exc:
                if exc is not timer:
                    raise
                raise _timed_out(url, left) from None

    def _exchange(self, url: str, body: bytes, content_type: str, left: float, request_id: str) -> Forwarded:
        headers = {"Content-Type": content_type, "X-Request-ID": request_id}
        try:
            with self.session.post(url, data=body, headers=headers, timeout=(self.connect_timeout_s, left),
                                   allow_redirects=False, stream=True) as resp:
                answer = self._read(resp)
                return Forwarded(resp.status_code, answer, resp.headers.get("Content-Type", ""))
        except requests.ConnectTimeout as exc:
            raise UpstreamFailed(f"connecting to GREENSERVE_IMMICH_UPSTREAM ({url}) took longer than "
                                 f"{self.connect_timeout_s}s") from exc
        except (requests.Timeout, ReadTimeoutError) as exc:  # the answer is read from urllib3's stream
            raise _timed_out(url, left) from exc
        except (requests.RequestException, Urllib3Error) as exc:
            raise UpstreamFailed(f"GREENSERVE_IMMICH_UPSTREAM ({url}) could not be reached: {reason(exc)}; is "
                                 "immich's machine-learning service running there?") from exc

    def _read(self, resp: requests.Response) -> bytes:
        parts: list[bytes] = []
        size = 0
        for chunk in resp.raw.stream(CHUNK_BYTES, decode_content=False):
            size += len(chunk)
            if size > self.max_answer_bytes:
                raise UpstreamFailed(f"GREENSERVE_IMMICH_UPSTREAM answered more than {self.max_answer_bytes} bytes "
                                     "(GREENSERVE_MAX_BODY_BYTES)", code="upstream_failed")
            parts.append(chunk)
        return b"".join(parts)


def _timed_out(url: str, left: float) -> DeadlineExceeded:
    return DeadlineExceeded(f"GREENSERVE_IMMICH_UPSTREAM ({url}) did not answer within the request's {left:.1f} s "
                            "left; a first face or OCR request makes immich download its model: preload it there "
                            "(MACHINE_LEARNING_PRELOAD__...), or raise GREENSERVE_REQUEST_TIMEOUT_S",
                            code="upstream_timeout")
