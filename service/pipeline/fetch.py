"""Stage 1: fetch image URLs concurrently on greenlets, each bounded in time, bytes, hops and retries.

    fetch_many  a gevent pool per request (GREENSERVE_FETCH_CONCURRENCY) inside a per-worker cap
                (GREENSERVE_FETCH_WORKER_CONCURRENCY); a URL given twice is fetched once; results come in
                completion order so decoding starts with the first image back
    fetch_one   one image under a *total* deadline (gevent.Timeout: requests' timeouts are per socket read,
                and a drip-feeding host never trips them); bounded retries with jittered backoff for connect
                errors and 429/502/503/504, Retry-After honoured when it fits the deadline; never for 4xx.
                With ``Validators`` it asks If-None-Match / If-Modified-Since, and a 304 is ``Fetched(None)``
    _follow     one attempt: redirects followed by hand, every hop checked by the address guard (ssrf.py),
                which also makes the connection go to exactly the checked address. Validators go only to the
                URL that sent them, reached through the same redirects (``Validators.chain``): a validator
                speaks for one URL's bytes (RFC 9110), and a host may reuse an ETag at another URL
    read_body   the body streamed against GREENSERVE_MAX_IMAGE_BYTES, decoded and sniffed (``fetch_body``)

One ``requests.Session`` per worker keeps connections alive per host. Its sockets are gevent's (see
``ssrf.PinnedHTTPConnection``), so the hub only waits. Every failure is an ``ImageError`` with a stable
code for that one image: a host that is down fails its images, never the worker.
"""

from __future__ import annotations

import email.utils
import hashlib
import logging
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timezone
from http.cookiejar import DefaultCookiePolicy
from typing import Protocol
from urllib.parse import urljoin, urlsplit

import gevent
import gevent.pool
import requests
from gevent.lock import BoundedSemaphore

from service.errors import FetchDeadline, FetchError, ImageError
from service.pipeline.fetch_body import YIELD, Pace, read_body, reason
from service.pipeline.ssrf import SCHEMES, AddressPolicy, GuardedAdapter, url_not_allowed
from service.settings import Settings

log = logging.getLogger(__name__)

USER_AGENT = "greenserve/0.1 (+image fetcher)"
RETRY_STATUSES = frozenset({429, 502, 503, 504})
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
BACKOFF_BASE_S = 0.1  # first retry after ~0.1 s, then 0.2, 0.4 ... (x0.5-1.5 jitter), at most BACKOFF_CAP_S
BACKOFF_CAP_S = 2.0
HOST_POOLS = 64  # hosts (per pinned address) whose keep-alive connections a worker keeps


@dataclass(frozen=True)
class Validators:
    """What a host said identifies a response (RFC 9110), and the redirects that led to the URL which said it
    (``chain_id``; empty: none): sent back only to that URL, reached the same way, to ask whether it changed."""

    etag: str = ""
    last_modified: str = ""
    chain: str = ""

    def headers(self) -> dict[str, str]:
        return {k: v for k, v in (("If-None-Match", self.etag), ("If-Modified-Since", self.last_modified)) if v}


@dataclass(frozen=True)
class Fetched:
    """An image's bytes, or None when the URL that sent the validators answered 304 Not Modified to them;
    with the response's validators and Cache-Control, and each redirect's Cache-Control in the order followed
    (what the embedding cache may do with it: a chain is fresh only while each of its responses is)."""

    data: bytes | None
    validators: Validators = Validators()
    cache_control: str = ""
    redirect_cache_control: tuple[str, ...] = ()


def chain_id(redirects: Sequence[str]) -> str:
    """The name of the URLs a fetch was redirected to, in order: empty for none, else a digest (a redirect's
    URL may be signed: it is compared, never kept)."""
    if not redirects:
        return ""
    return hashlib.sha256("\n".join(redirects).encode("utf-8", "surrogatepass")).hexdigest()[:40]


FetchResult = Fetched | ImageError


class Fetcher(Protocol):
    """Fetch ``urls``; yield ``(index, Fetched or ImageError)`` as each completes (any order). A URL in
    ``validators`` is asked conditionally where it reaches the URL that sent them through the same redirects:
    its ``Fetched.data`` is None only when that URL says it has not changed."""

    def fetch_many(self, urls: Sequence[str], *, deadline: float | None = None, request_id: str = "",
                   validators: Mapping[str, Validators] | None = None) -> Iterator[tuple[int, FetchResult]]: ...


class _Retry(Exception):
    """An attempt failed in a way another attempt may fix (``retry_after``: what the host asked for)."""

    def __init__(self, error: FetchError, retry_after: float | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.retry_after = retry_after


class HttpFetcher:
    """The worker's fetcher. ``session`` (optional) gets the guarded adapters mounted in place of its own;
    ``policy`` replaces the one built from settings; ``verify`` is requests' TLS verify (a CA bundle path);
    ``pace`` is what the hub does between chunks of a body (the worker's ``Urgency``)."""

    def __init__(self, settings: Settings, session: requests.Session | None = None, *,
                 policy: AddressPolicy | None = None, verify: bool | str = True, pace: Pace | None = None) -> None:
        self.settings = settings
        self.pace = pace or YIELD
        self.policy = policy or AddressPolicy.from_settings(settings)
        self.session = _configure(session or requests.Session(), settings, self.policy)
        self.verify = verify
        self._slots = BoundedSemaphore(settings.fetch_worker_concurrency)

    def fetch_many(self, urls: Sequence[str], *, deadline: float | None = None, request_id: str = "",
                   validators: Mapping[str, Validators] | None = None) -> Iterator[tuple[int, FetchResult]]:
        positions: dict[str, list[int]] = {}
        for i, url in enumerate(urls):
            positions.setdefault(url, []).append(i)
        pool = gevent.pool.Pool(self.settings.fetch_concurrency)

        def one(url: str) -> tuple[str, FetchResult]:
            result = self.fetch_one(url, deadline=deadline, validators=(validators or {}).get(url))
            if isinstance(result, ImageError):
                log.warning("fetch failed request_id=%s url=%s code=%s: %s", request_id, url[:200],
                            result.code, result.message)
            return url, result

        try:
            for url, result in pool.imap_unordered(one, list(positions)):
                for i in positions[url]:
                    yield i, result
        finally:
            pool.kill(block=False)  # the caller stopped early (request deadline, error): stop the rest

    def fetch(self, url: str, *, deadline: float | None = None) -> bytes | ImageError:
        """One image's bytes, or the error that explains why not."""
        result = self.fetch_one(url, deadline=deadline)
        if isinstance(result, ImageError):
            return result
        assert result.data is not None  # asked without validators: never a 304
        return result.data

    def fetch_one(self, url: str, *, deadline: float | None = None,
                  validators: Validators | None = None) -> FetchResult:
        """One image (conditionally with ``validators``), or the error that explains why not. Never raises
        for the URL's sake."""
        wait = None if deadline is None else deadline - time.monotonic()
        if wait is not None and wait <= 0 or not self._slots.acquire(timeout=wait):
            return FetchDeadline("the request deadline passed before this image could be fetched")
        try:
            budget = self.settings.fetch_timeout_s
            if deadline is not None:
                budget = min(budget, deadline - time.monotonic())
            if budget <= 0:
                return FetchDeadline("the request deadline passed before this image could be fetched")
            with gevent.Timeout(budget) as timer:
                try:
                    return self._with_retries(url, time.monotonic() + budget, validators)
                except gevent.Timeout as exc:
                    if exc is not timer:
                        raise
                    if budget < self.settings.fetch_timeout_s:  # the request's deadline, not the image's
                        return FetchDeadline(f"fetching took longer than the {budget:.1f}s the request deadline "
                                             "left")
                    return FetchError(f"fetching took longer than {budget:.1f}s (GREENSERVE_FETCH_TIMEOUT_S); check "
                                      "the image host or allow more time", code="fetch_timeout")
                except ImageError as err:
                    return err
        finally:
            self._slots.release()

    def _with_retries(self, url: str, until: float, validators: Validators | None) -> Fetched:
        retries = self.settings.fetch_retries
        for attempt in range(retries + 1):
            try:
                return self._follow(url, until, validators)
            except _Retry as retry:
                error = retry.error
                if attempt == retries:
                    raise FetchError(f"{error.message} (after {retries + 1} attempts)", code=error.code,
                                     details=error.details) from retry
                wait = retry.retry_after if retry.retry_after is not None else _backoff(attempt)
                if time.monotonic() + wait >= until:
                    # the host asked for more time than the deadline leaves: fail now, not at the deadline
                    raise FetchError(f"{error.message}; retrying after {wait:.1f}s would pass the "
                                     "deadline", code=error.code, details=error.details) from retry
                gevent.sleep(wait)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _follow(self, url: str, until: float, validators: Validators | None) -> Fetched:
        redirects: list[str] = []
        relayed: list[str] = []  # each redirect's Cache-Control
        for _ in range(self.settings.fetch_max_redirects + 1):
            # only the URL that sent the validators, reached the same way, is asked with them: a 304 from any
            # other would vouch for bytes it never sent
            ask = validators if validators and validators.chain == chain_id(redirects) else None
            with self._send(url, until, ask.headers() if ask else {}) as resp:
                target = self.session.get_redirect_target(resp) if resp.status_code in REDIRECT_STATUSES else None
                if target:
                    url = urljoin(resp.url, target)
                    if urlsplit(url).scheme.lower() not in SCHEMES:
                        raise url_not_allowed(f"the image host redirected to a {urlsplit(url).scheme}: URL, "
                                              "which is not fetched (only http and https)", hint=False)
                    redirects.append(url)
                    relayed.append(resp.headers.get("Cache-Control", ""))
                    continue
                if resp.status_code == 200 or resp.status_code == 304 and ask:
                    found = Validators(resp.headers.get("ETag", ""), resp.headers.get("Last-Modified", ""),
                                       chain_id(redirects))
                    if resp.status_code == 304 and ask:  # a 304 may leave out the validators it confirms
                        found = Validators(found.etag or ask.etag, found.last_modified or ask.last_modified, ask.chain)
                    body = read_body(resp, self.settings.max_image_bytes, self.pace) if resp.status_code == 200 else None
                    return Fetched(body, found, resp.headers.get("Cache-Control", ""), tuple(relayed))
                raise _status_error(resp)
        raise FetchError(f"more than {self.settings.fetch_max_redirects} redirects; link the image itself or "
                         "raise GREENSERVE_FETCH_MAX_REDIRECTS", code="fetch_failed")

    def _send(self, url: str, until: float, headers: dict[str, str]) -> requests.Response:
        timeout = (self.settings.fetch_connect_timeout_s, max(0.05, until - time.monotonic()))
        try:
            return self.session.get(url, stream=True, allow_redirects=False, verify=self.verify,
                                    timeout=timeout, headers=headers)
        except requests.exceptions.SSLError as exc:
            raise FetchError(f"TLS with the image host failed: {reason(exc)}", code="fetch_failed") from exc
        except requests.ConnectTimeout as exc:
            raise _Retry(FetchError(f"connecting to the image host took longer than {timeout[0]}s",
                                    code="fetch_timeout")) from exc
        except requests.ConnectionError as exc:
            # refused, unreachable or reset before any answer: a GET is safe to send again
            raise _Retry(FetchError(f"could not fetch the image: {reason(exc)}", code="fetch_failed")) from exc
        except requests.Timeout as exc:
            raise FetchError("the image host did not answer in time", code="fetch_timeout") from exc
        except (requests.exceptions.InvalidURL, requests.exceptions.InvalidSchema,
                requests.exceptions.MissingSchema) as exc:
            raise FetchError(f"the URL is not valid: {reason(exc)}", code="invalid_url") from exc
        except requests.RequestException as exc:
            raise FetchError(f"could not fetch the image: {reason(exc)}", code="fetch_failed") from exc


def _configure(session: requests.Session, settings: Settings, policy: AddressPolicy) -> requests.Session:
    session.headers.update({"User-Agent": USER_AGENT, "Accept": "image/*",
                            "Accept-Encoding": "identity"})  # images are compressed already
    session.trust_env = False  # a proxy or netrc from the environment must not silently route the fetcher
    session.max_redirects = settings.fetch_max_redirects
    # one session serves every caller: a host must not plant cookies that later requests would send
    session.cookies.set_policy(DefaultCookiePolicy(allowed_domains=[]))
    adapter = GuardedAdapter(policy, pool_connections=HOST_POOLS, pool_maxsize=settings.fetch_worker_concurrency,
                             max_retries=0)
    session.adapters.clear()  # no other mount (a longer prefix) may bypass the guard
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


def _status_error(resp: requests.Response) -> Exception:
    status = resp.status_code
    hint = "check the URL" if 400 <= status < 500 and status != 429 else "the image host may be down"
    error = FetchError(f"the image host answered HTTP {status} {resp.reason or ''}".rstrip() + f"; {hint}",
                       code="fetch_failed", details=[{"upstream_status": status}])
    if status in RETRY_STATUSES:
        return _Retry(error, _retry_after(resp.headers.get("Retry-After")))
    return error


def _retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date); None when absent or unreadable."""
    value = (value or "").strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, when.timestamp() - time.time())


def _backoff(attempt: int) -> float:
    return float(min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** attempt) * random.uniform(0.5, 1.5))
