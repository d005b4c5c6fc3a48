"""recall: a URL's record keeps the redirects that led to its validators, and a redirected URL is fresh only
while every response on the way is."""

from __future__ import annotations

import numpy as np

from harness import images
from service.cache.entries import Outputs
from service.cache.stores import MemoryStore
from service.cache.tiers import EmbeddingCache
from service.pipeline.fetch import Fetched, Validators
from service.pipeline.recall import CacheTally, Recall

URL = "http://cdn.test/cover.jpg"
DATA = images.jpeg(40, 40)
CHAIN = "c" * 40  # fetch.chain_id of the redirects followed


def embedded(got: Fetched) -> Recall:
    """The next request's recall, after one that fetched ``URL`` as ``got`` and embedded it."""
    cache = EmbeddingCache(MemoryStore(1 << 20), None, ttl_s=60)
    first = Recall(cache, "m" * 32, CacheTally())
    first.prefetch([URL], {})
    assert first.recall(0, URL, got) is None
    first.keep(0, Outputs(np.ones(4, np.float32), None))
    first.flush()
    after = Recall(cache, "m" * 32, CacheTally())
    after.prefetch([URL], {})
    return after


def test_a_url_record_keeps_the_redirects_that_led_to_its_validators() -> None:
    after = embedded(Fetched(DATA, Validators('"v1"', "", CHAIN), redirect_cache_control=("",)))
    assert after.validators([URL]) == {URL: Validators('"v1"', "", CHAIN)}


def test_a_redirected_url_is_fresh_only_while_every_redirect_is() -> None:
    fresh = Validators('"v1"', "", CHAIN)
    assert embedded(Fetched(DATA, fresh, "max-age=300", ("max-age=60",))).fresh(URL) is not None
    assert embedded(Fetched(DATA, fresh, "max-age=300", ("",))).fresh(URL) is None  # a plain 302: follow it again
    assert embedded(Fetched(DATA, fresh, "max-age=300", ("max-age=60", "no-cache"))).fresh(URL) is None
    assert embedded(Fetched(DATA, fresh, "max-age=300")).fresh(URL) is not None  # no redirect
