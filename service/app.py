"""create_app(): the only place the parts meet.

    settings ─▶ runner (model + inference thread + decode pool + batcher)
             ─▶ fetcher (concurrent, bounded URL fetching)
             ─▶ orchestrator (fetch → decode → infer → postprocess for one request)
             ─▶ api (Flask routes + error handler)
"""

from __future__ import annotations

import functools
import logging

from flask import Flask

from service import api, logs, metrics
from service.engine.runner import Model, Runner
from service.pipeline.decode import configure_pillow
from service.pipeline.fetch import Fetcher, HttpFetcher
from service.pipeline.orchestrate import Orchestrator
from service.settings import Settings

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None, *, model: Model | None = None,
               fetcher: Fetcher | None = None) -> Flask:
    """Build the app. Without ``model`` the real one loads in the background (``/readyz`` says when)."""
    settings = settings or Settings.from_env()
    logs.configure(settings.log_level)
    configure_pillow(settings.max_image_pixels)
    runner = Runner(settings, model=model, loader=None if model else functools.partial(_load_model, settings))
    orchestrator = Orchestrator(runner, fetcher or HttpFetcher(settings), max_pixels=settings.max_image_pixels,
                                on_image_error=lambda err: metrics.IMAGE_ERRORS.labels(err.code).inc())
    app = Flask("greenserve")
    app.extensions["greenserve"] = {"settings": settings, "runner": runner, "orchestrator": orchestrator}
    api.register(app)
    runner.start()
    return app


def _load_model(settings: Settings) -> Model:
    """Runs in the worker's inference thread, after fork: the first torch op of this process."""
    import torch  # imported here so the master (which imports this module's parents) never needs torch

    from service import worker
    from service.engine.model import load_model, resolve_device

    torch.set_num_threads(settings.torch_threads_per_worker())
    device = resolve_device(settings.device, worker.slot())
    log.info("loading %s (weights=%s) on %s with %d torch thread(s)", settings.model, settings.weights,
             device, torch.get_num_threads())
    return load_model(settings.model, settings.weights, device=device, channels_last=settings.channels_last,
                      dtype=getattr(torch, settings.dtype))
