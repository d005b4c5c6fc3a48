"""Stage 1: fetch image URLs concurrently on greenlets, each bounded in time and bytes.

One ``requests.Session`` per worker (keep-alive per host over gevent's patched sockets); a pool of
``GREENSERVE_FETCH_CONCURRENCY`` greenlets per request. requests' own timeouts are per socket read,
so a drip-feeding host never trips them: a ``gevent.Timeout`` bounds each image's total time.
"""

from __future__ import annotations

import logging
import time
from typing import Iterator, Protocol, Sequence

import gevent
import gevent.pool
import requests

from service.errors import FetchError, ImageError, ImageTooLarge
from service.settings import Settings

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 1024
USER_AGENT = "greenserve/0.1 (+image fetcher)"

FetchResult = bytes | ImageError


class Fetcher(Protocol):
    """Fetch ``urls``; yield ``(index, bytes or ImageError)`` as each completes (any order)."""

    def fetch_many(self, urls: Sequence[str], *, deadline: float | None = None,
                   request_id: str = "") -> Iterator[tuple[int, FetchResult]]: ...


class HttpFetcher:
    def __init__(self, settings: Settings, session: requests.Session | None = None) -> None:
        self.settings = settings
        self.session = session or _session(settings)

    def fetch_many(self, urls: Sequence[str], *, deadline: float | None = None,
                   request_id: str = "") -> Iterator[tuple[int, FetchResult]]:
        pool = gevent.pool.Pool(self.settings.fetch_concurrency)

        def one(i: int) -> tuple[int, FetchResult]:
            result = self.fetch(urls[i], deadline=deadline)
            if isinstance(result, ImageError):
                log.warning("fetch failed request_id=%s url=%s code=%s: %s", request_id, urls[i],
                            result.code, result.message)
            return i, result

        yield from pool.imap_unordered(one, range(len(urls)))

    def fetch(self, url: str, *, deadline: float | None = None) -> FetchResult:
        """One image, as bytes or as the error that explains why not. Never raises for the URL's sake."""
        budget = self.settings.fetch_timeout_s
        if deadline is not None:
            budget = min(budget, deadline - time.monotonic())
        if budget <= 0:
            return FetchError("the request deadline passed before this image was fetched",
                              code="fetch_timeout")
        try:
            with gevent.Timeout(budget):
                return self._get(url)
        except gevent.Timeout:
            return FetchError(f"fetching took longer than {budget:.1f}s; check the image host or raise "
                              "GREENSERVE_FETCH_TIMEOUT_S", code="fetch_timeout")
        except ImageError as err:
            return err

    def _get(self, url: str) -> bytes:
        cap = self.settings.max_image_bytes
        try:
            with self.session.get(url, stream=True, allow_redirects=True,
                                  timeout=(self.settings.fetch_connect_timeout_s, self.settings.fetch_timeout_s)) as r:
                if r.status_code != 200:
                    raise FetchError(f"the image host answered HTTP {r.status_code} for this URL",
                                     code="fetch_failed", details=[{"upstream_status": r.status_code}])
                declared = r.headers.get("Content-Length")
                if declared and declared.isdigit() and int(declared) > cap:
                    raise _too_large(int(declared), cap)
                body = bytearray()
                for chunk in r.iter_content(CHUNK_BYTES):
                    body += chunk
                    if len(body) > cap:
                        raise _too_large(len(body), cap, more=True)
                return bytes(body)
        except requests.TooManyRedirects as exc:
            raise FetchError(f"more than {self.settings.fetch_max_redirects} redirects",
                             code="fetch_failed") from exc
        except requests.Timeout as exc:
            raise FetchError("the image host did not answer in time", code="fetch_timeout") from exc
        except (requests.ConnectionError, requests.RequestException) as exc:
            raise FetchError(f"could not fetch the image: {_reason(exc)}", code="fetch_failed") from exc


def _session(settings: Settings) -> requests.Session:
    s = requests.Session()
    s.max_redirects = settings.fetch_max_redirects
    s.headers["User-Agent"] = USER_AGENT
    s.trust_env = False  # a proxy from the environment must not silently route the fetcher
    adapter = requests.adapters.HTTPAdapter(pool_connections=32, pool_maxsize=settings.fetch_concurrency)
    s.mount("http://", adapter)
    s.mount("https://", adapter)
    return s


def _too_large(size: int, cap: int, more: bool = False) -> ImageTooLarge:
    return ImageTooLarge(f"the image is {'more than ' if more else ''}{size} bytes; the limit is {cap} bytes. "
                         "Send a smaller image or set GREENSERVE_MAX_IMAGE_BYTES")


def _reason(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) < 200 else text[:200] + "..."
