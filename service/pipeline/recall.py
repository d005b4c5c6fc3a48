"""One request's use of the embedding cache (``service.cache``): which images it need not decode and infer.

    prefetch     an album's URL records, then the entries they point at, in one store call each; uploads'
                 contents hashed together and their entries found in one call
    fresh        a URL inside the host's max-age whose entry is known: answered without a request
    validators   the URLs worth asking conditionally (their entry is in hand, so a 304 answers at once)
    recall       a 304's entry, or the entry of the bytes just fetched or uploaded (by content id), or None
    keep         a computed row's outputs and its URL's record, written in one call when the request ends

A URL is never enough to answer: only its validators confirmed by the URL that sent them, reached through the
same redirects (a 304), the max-age of every response on the way, or the bytes themselves. ``Cache-Control:
no-store`` from the host: nothing read or written for that image; from the caller, for its request
(``no-cache``: every image embedded again, and stored).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import PIL
import torch

from service import metrics
from service.cache import entries
from service.cache.entries import Outputs, UrlRecord
from service.cache.tiers import EmbeddingCache
from service.engine.types import ModelInfo
from service.pipeline.fetch import Fetched, Validators


@dataclass
class CacheTally:
    """What the cache did for one request's images: its ``Cache-Status`` header (RFC 9211)."""

    hits: int = 0  # no decode, no forward (``revalidated`` and ``fresh`` of them did not download either)
    revalidated: int = 0
    fresh: int = 0
    misses: int = 0
    bypassed: int = 0  # no-store, or the store did not answer
    stored: bool = False
    read: bool = True  # the request lets the cache answer (no Cache-Control: no-cache / no-store)
    write: bool = True  # and lets what it computes be stored (no Cache-Control: no-store)

    def header(self) -> str:
        detail = f'detail="hit={self.hits} revalidated={self.revalidated} fresh={self.fresh} miss={self.misses}' \
                 f'{f" bypass={self.bypassed}" if self.bypassed else ""}"'
        if self.misses or self.bypassed:
            return f"greenserve; fwd={'miss' if self.misses else 'bypass'}{'; stored' if self.stored else ''}; {detail}"
        if self.revalidated:
            return f"greenserve; fwd=stale; fwd-status=304; {detail}"
        return f"greenserve; hit; {detail}"


def model_id(info: ModelInfo) -> str:
    """The cache's name for what produced ``info``'s outputs (``entries.model_id``)."""
    t = info.transform
    precision = info.precision
    return entries.model_id({
        "family": info.family, "name": info.name, "weights": info.weights, "weights_digest": info.weights_digest,
        "format": info.format, "dtype": info.dtype, "device": info.device, "jpeg_decode": info.jpeg_decode,
        "numerics": {c.tower: c.numerics for c in precision.towers} if precision else {},
        "hardware": precision.hardware if precision else "",
        # "exact" only where set: the keys of the other models' stored outputs stay what they were
        "transform": [t.resize_size, t.crop_size, t.resize_mode, t.interpolation, list(t.mean), list(t.std),
                      *(["exact"] if t.exact else [])],
        "torch": torch.__version__, "pillow": PIL.__version__})


@dataclass
class Recall:
    cache: EmbeddingCache
    model: str  # ``model_id``
    tally: CacheTally
    _records: dict[str, UrlRecord] = field(default_factory=dict)  # by URL, as found or as fetched now
    _found: dict[str, Outputs] = field(default_factory=dict)  # by content id
    _content: dict[int, str] = field(default_factory=dict)  # image index -> content id, hashed this request
    _unkept: set[int] = field(default_factory=set)  # no-store images
    _pending: dict[str, bytes] = field(default_factory=dict)
    _answered: bool = True  # the last lookup reached every store: what it did not find is a miss, not a bypass

    def prefetch(self, urls: Sequence[str], uploads: Mapping[int, bytes]) -> None:
        if not self.tally.read:
            return
        keys = {entries.url_key(u): u for u in urls}
        found, _ = self.cache.get_many(list(keys))
        for key, url in keys.items():
            record = entries.unpack_url(key, found.get(key))
            if record is not None:
                self._records[url] = record
        self._content.update(zip(uploads, self.cache.digest_many(list(uploads.values())), strict=True))
        self._lookup({r.content for r in self._records.values()} | set(self._content.values()))

    def fresh(self, url: str) -> Outputs | None:
        record = self._records.get(url)
        if record is None or record.fresh_until <= time.time() or record.content not in self._found:
            return None
        self._count(fresh=True, revalidated=False)
        metrics.CACHE_REVALIDATIONS.labels("fresh").inc()
        return self._found[record.content]

    def validators(self, urls: Sequence[str]) -> dict[str, Validators]:
        return {u: Validators(r.etag, r.last_modified, r.chain) for u in urls if (r := self._records.get(u)) is not None
                and (r.etag or r.last_modified) and r.content in self._found}

    def recall(self, index: int, url: str | None, got: Fetched | bytes) -> Outputs | None:
        """The outputs already known for image ``index``, or None: decode and infer it, then ``keep``."""
        directives = _directives(got.cache_control) if isinstance(got, Fetched) else {}
        if isinstance(got, Fetched):
            if url is not None and got.data is None:  # 304 from the URL the record's validators came from
                record = self._records[url]
                metrics.CACHE_REVALIDATIONS.labels("not_modified").inc()
                if "no-store" not in directives:
                    self._remember(url, record.content, got, directives)
                self._count(fresh=False, revalidated=True)
                return self._found[record.content]  # (a 304 has no body to embed: the entry answers)
            if "no-store" in directives:
                self._unkept.add(index)
                self._bypass()
                return None
            if url in self._records:
                metrics.CACHE_REVALIDATIONS.labels("modified").inc()
            data = got.data
        else:
            data = got
        assert data is not None
        content = self._content.get(index) or self.cache.digest(data)
        self._content[index] = content
        if not self.tally.read:
            self._bypass()
            return None
        if content not in self._found:
            self._lookup({content})
        if url is not None and isinstance(got, Fetched):
            self._remember(url, content, got, directives)
        return self._counted(self._found.get(content))

    def keep(self, index: int, outputs: Outputs) -> None:
        content = self._content.get(index)
        if content is None or index in self._unkept:
            return
        key = entries.entry_key(self.model, content)
        self._pending[key] = entries.pack(key, outputs)

    def flush(self) -> None:
        """The request's new entries and URL records, in one store call."""
        if self._pending and self.tally.write:
            self.tally.stored = self.cache.put_many(self._pending) and any(k.startswith("e:") for k in self._pending)
            self._pending = {}

    def _remember(self, url: str, content: str, got: Fetched, directives: Mapping[str, Any]) -> None:
        # a redirect is a response too: the chain is fresh only while each of its responses is (RFC 9111 4.2;
        # a redirect without max-age is not, so it is followed again and its target asked conditionally)
        max_age = min([_max_age(directives), *(_max_age(_directives(c)) for c in got.redirect_cache_control)])
        if not (got.validators.etag or got.validators.last_modified or max_age):
            return  # nothing to ask again with: the next fetch downloads, and its content finds the entry
        old = self._records.get(url)
        v = got.validators
        record = UrlRecord(content, v.etag, v.last_modified, time.time() + max_age if max_age else 0.0, v.chain)
        if record != old:
            self._records[url] = record
            key = entries.url_key(url)
            self._pending[key] = entries.pack_url(key, record)

    def _lookup(self, contents: set[str]) -> None:
        keys = {entries.entry_key(self.model, c): c for c in contents if c not in self._found}
        if not keys:
            return
        found, self._answered = self.cache.get_many(list(keys))
        for key, content in keys.items():
            outputs = entries.unpack(key, found.get(key))
            if outputs is not None:
                self._found[content] = outputs

    def _counted(self, outputs: Outputs | None) -> Outputs | None:
        if outputs is not None:
            self._count(fresh=False, revalidated=False)
        elif self._answered:
            self.tally.misses += 1
            metrics.CACHE_LOOKUPS.labels("miss").inc()
        else:
            self._bypass()
        return outputs

    def _bypass(self) -> None:
        self.tally.bypassed += 1
        metrics.CACHE_LOOKUPS.labels("bypass").inc()

    def _count(self, *, fresh: bool, revalidated: bool) -> None:
        self.tally.hits += 1
        self.tally.fresh += fresh
        self.tally.revalidated += revalidated
        metrics.CACHE_LOOKUPS.labels("hit").inc()


def _directives(header: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in header.lower().split(","):
        name, _, value = part.strip().partition("=")
        if name:
            out[name] = value.strip().strip('"')
    return out


def _max_age(directives: Mapping[str, Any]) -> float:
    """How long a response may be used without asking (0 under no-cache or no-store)."""
    return 0.0 if "no-cache" in directives or "no-store" in directives else _seconds(directives.get("max-age"))


def _seconds(value: str | None) -> float:
    return float(value) if value and value.isdigit() else 0.0
