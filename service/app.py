"""create_app(): the only place the parts meet.

    settings ─▶ balance (this worker's connections, load and accept gate; from gunicorn's worker)
             ─▶ runner (model + inference thread + decode pool + batcher; reads the siblings' loads)
             ─▶ fetcher (concurrent, bounded URL fetching)
             ─▶ orchestrator (fetch → decode → infer → postprocess for one request)
             ─▶ http (hooks, native routes, the protocols' routes, /openapi.json: every blueprint
                registered here; the body guard around them)
"""

from __future__ import annotations

import dataclasses
import functools
import logging

from flask import Flask

from service import logs, metrics
from service.balance.gate import Balance, Policy
from service.engine.runner import Model, Runner
from service.http import hooks, openapi, protocols, routes
from service.http.connection import guard_body, werkzeug_limits
from service.pipeline.decode import configure_pillow
from service.pipeline.fetch import Fetcher, HttpFetcher
from service.pipeline.orchestrate import Orchestrator
from service.pipeline.texts import TextEncoder
from service.settings import Settings

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None, *, model: Model | None = None,
               fetcher: Fetcher | None = None, balance: Balance | None = None) -> Flask:
    """Build the app. Without ``model`` the real one loads in the background (``/readyz`` says when);
    ``balance`` is the gunicorn worker's (``wsgi.py``), else one that only counts."""
    settings = settings or Settings.from_env()
    logs.configure(settings.log_level, settings.log_format)
    configure_pillow(settings.max_image_pixels)
    balance = balance or Balance(None, Policy.from_settings(settings))
    runner = Runner(settings, model=model, siblings=balance,
                    loader=None if model else functools.partial(_load_model, settings, balance.slot))
    texts = TextEncoder(runner, settings.label_cache_size)
    orchestrator = Orchestrator(runner, fetcher or HttpFetcher(settings), texts, max_pixels=settings.max_image_pixels,
                                on_image_error=lambda err: metrics.IMAGE_ERRORS.labels(err.code).inc())
    app = Flask("greenserve")
    app.extensions["greenserve"] = {"settings": settings, "runner": runner, "orchestrator": orchestrator,
                                    "balance": balance, "texts": texts}
    for blueprint in (hooks.bp, routes.bp, *protocols.BLUEPRINTS, openapi.bp):
        app.register_blueprint(blueprint)
    app.config.update(werkzeug_limits(settings))
    # Flask's middleware hook
    app.wsgi_app = guard_body(app.wsgi_app, settings.max_body_bytes,  # type: ignore[method-assign,assignment]
                              settings.body_timeout_s)
    runner.start()
    balance.start(readiness=runner)
    return app


def _load_model(settings: Settings, slot: int) -> Model:
    """Runs in the worker's inference thread, after fork: the first torch op of this process."""
    import torch  # imported here so the master (which imports this module's parents) never needs torch

    from service.engine import device_decode, precision
    from service.engine.loading import load_model, resolve_device

    torch.set_num_threads(settings.torch_threads_per_worker())
    device = resolve_device(settings.device, slot)
    log.info("loading %s (weights=%s) on %s with %d torch thread(s)", settings.model, settings.weights,
             device, torch.get_num_threads())
    model = load_model(settings.model, settings.weights, device=device, channels_last=settings.channels_last)
    # before warm-up (it warms the chosen numerics), timed at the sizes the batchers form
    precision.settle(model, settings.dtype, cpu_bf16=settings.cpu_bf16,
                     image_sizes=precision.batch_sizes(settings.max_batch),
                     text_sizes=precision.batch_sizes(settings.max_text_batch))
    on_device, why = device_decode.usable(settings.jpeg_decode, device, model.info.transform)
    model.info = dataclasses.replace(model.info, jpeg_decode="device" if on_device else "pillow")
    log.info("JPEG decoding: %s (%s)", model.info.jpeg_decode, why)
    return model
