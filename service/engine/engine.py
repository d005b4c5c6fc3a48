"""One served model in a worker: its name and spec, its loaded model once ready (or why it failed to load),
and its forwards. The worker's ``runner.Runner`` holds one per served model; they share its inference thread,
its decode threads and its scheduling."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol, cast

import numpy as np
from gevent.event import Event

from service.engine.model_set import ModelSpec
from service.engine.types import BatchOutputs, EncodedJpeg, ModelInfo, Tokens


class Model(Protocol):
    """What an engine needs of a model (the real one is ``service.engine.model.LoadedModel``)."""

    info: ModelInfo

    def forward(self, batch: np.ndarray) -> tuple[Any, Any]: ...

    def warm_up(self) -> None: ...


class DeviceDecodingModel(Model, Protocol):
    """A model that decodes JPEGs on its device (``info.jpeg_decode == "device"``)."""

    def forward_items(self, items: Sequence[np.ndarray | EncodedJpeg]) -> tuple[Any, Any, dict[int, Exception]]: ...


class TextModel(Model, Protocol):
    """A model with a text tower (``info.towers`` has "text")."""

    def tokenize(self, texts: Sequence[str]) -> Tokens: ...

    def encode_text(self, ids: np.ndarray) -> Any: ...


class Engine:
    def __init__(self, spec: ModelSpec, model: Model | None = None) -> None:
        self.spec = spec
        self.model = model
        self.load_error: BaseException | None = None
        self.withdrawn = False  # unloaded through the repository API: its requests are refused
        self._ready = Event()
        self.image_costs: dict[int, float] = {}  # its image forward's ms per image by batch size (the gather's stop)
        if model is not None:
            self.loaded(model)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def ready(self) -> bool:
        return self.model is not None and bool(self._ready.is_set())

    @property
    def info(self) -> ModelInfo | None:
        """The loaded model's facts, or None while it loads (or after it failed)."""
        return self.model.info if self.model is not None else None

    def loaded(self, model: Model) -> None:
        self.model = model
        choice = model.info.precision.tower("image") if model.info.precision is not None else None
        self.image_costs = choice.per_image_ms() if choice is not None else {}
        self._ready.set()

    def failed(self, error: BaseException) -> None:
        self.load_error = error

    def forward(self, batch: np.ndarray | list[np.ndarray | EncodedJpeg]) -> tuple[Any, Any] | BatchOutputs:
        """One image batch (the inference thread)."""
        assert self.model is not None and threading.current_thread() is not threading.main_thread()
        if isinstance(batch, np.ndarray):
            return self.model.forward(batch)
        return BatchOutputs(*cast(DeviceDecodingModel, self.model).forward_items(batch))  # JPEGs for the device

    def text_model(self) -> TextModel:
        # requests for text reach here only admitted (the model is loaded) and checked by the data plane,
        # which refuses them with text_not_supported when the model has no text tower
        assert self.info is not None and "text" in self.info.towers
        return cast(TextModel, self.model)
