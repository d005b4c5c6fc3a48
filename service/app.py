"""create_app(): the only place the parts meet.

    settings ─▶ balance (this worker's connections, load and accept gate; from gunicorn's worker)
             ─▶ runner (model + inference thread + decode pool + batcher; reads the siblings' loads; the
                numerics as the server's memo or the fleet's record in the shared cache has them)
             ─▶ fetcher (concurrent, bounded URL fetching)
             ─▶ cache (embeddings by image content: memory, then disk or redis; GREENSERVE_CACHE)
             ─▶ orchestrator (fetch → decode → infer → postprocess for one request)
             ─▶ data plane (the request path every protocol shares: parse, check, run; in app.extensions)
             ─▶ upstream (immich's own ML service, for the immich tasks greenserve does not run; in app.extensions)
             ─▶ http (hooks, native routes, the protocols' routes, /openapi.json, the page at /: every blueprint
                registered here; the body guard around them)
"""

from __future__ import annotations

import dataclasses
import functools
import logging

from flask import Flask

from service import logs, metrics
from service.balance.gate import Balance, Policy
from service.balance.repository import Follower
from service.cache import fleet, tiers
from service.cache.tiers import EmbeddingCache
from service.engine.engine import Model
from service.engine.loading import import_family, load_for_worker
from service.engine.model_set import model_set
from service.engine.runner import Runner
from service.http import current, hooks, openapi, protocols, routes, ui
from service.http.connection import guard_body, werkzeug_limits
from service.http.context import Identities
from service.http.dataplane import DataPlane
from service.http.protocols import immich
from service.http.upstream import HttpUpstream, Upstream
from service.pipeline import device_decode
from service.pipeline.decode import configure_pillow
from service.pipeline.fetch import Fetcher, HttpFetcher
from service.pipeline.orchestrate import Orchestrator
from service.pipeline.text_encoder import TextEncoder
from service.settings import Settings

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None, *, model: Model | None = None,
               fetcher: Fetcher | None = None, balance: Balance | None = None,
               cache: EmbeddingCache | None = None, upstream: Upstream | None = None) -> Flask:
    """Build the app. Without ``model`` the real one loads in the background (``/readyz`` says when);
    ``balance`` is the gunicorn worker's (``wsgi.py``), else one that only counts; ``cache`` replaces the
    embedding cache ``GREENSERVE_CACHE`` names; ``upstream`` the immich service ``GREENSERVE_IMMICH_UPSTREAM`` names."""
    settings = settings or Settings.from_env()
    logs.configure(settings.log_level, settings.log_format)
    configure_pillow(settings.max_image_pixels)
    balance = balance or Balance(None, Policy.from_settings(settings))
    if model is not None:
        runner = Runner(settings, model=model, siblings=balance)
    else:
        loaders = {}
        for spec in model_set(settings):
            import_family(spec.model)  # in this thread, not the loader's (``import_family`` says why)
            own = dataclasses.replace(settings, model=spec.model, weights=spec.weights, models="")
            # the numerics: as this server's earlier workers measured them (the memo), else the fleet's (its Redis)
            loaders[spec.name] = functools.partial(load_for_worker, own, balance.slot, device_decode, balance.memo,
                                                   fleet.from_settings(settings))
        runner = Runner(settings, siblings=balance, loaders=loaders)
    texts = TextEncoder(runner, settings.label_cache_size, max_tokens=settings.max_text_tokens)
    fetcher = fetcher or HttpFetcher(settings, pace=runner.scheduling.urgency)  # reads wait while urgent work runs
    orchestrator = Orchestrator(runner, fetcher, texts, max_pixels=settings.max_image_pixels,
                                on_image_error=lambda err: metrics.IMAGE_ERRORS.labels(err.code).inc(),
                                cache=cache if cache is not None else tiers.from_settings(settings))
    app = Flask("greenserve")
    who = Identities.of(settings.caller_from, settings.api_token, settings.trusted_proxies)
    # which models the host's workers serve, agreed on the master's board (the repository API)
    repository = Follower(balance.repository, balance.slot, list(runner.engines), runner.serve, runner.serving,
                          balance.live_slots)
    app.extensions[current.EXTENSION] = DataPlane(settings, runner, orchestrator, balance, who, repository)
    app.extensions[immich.UPSTREAM] = upstream or HttpUpstream.from_settings(settings)
    for blueprint in (hooks.bp, routes.bp, *protocols.BLUEPRINTS, openapi.bp, ui.bp):
        app.register_blueprint(blueprint)
    app.config.update(werkzeug_limits(settings))
    # Flask's middleware hook
    app.wsgi_app = guard_body(app.wsgi_app, settings.max_body_bytes,  # type: ignore[method-assign,assignment]
                              settings.body_timeout_s)
    runner.start()
    repository.start()
    balance.start(readiness=runner)
    return app
