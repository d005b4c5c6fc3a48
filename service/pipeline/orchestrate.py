"""One request through the stages, each image flowing on as soon as its previous stage is done:

    1. admit     reserve queue slots for the images, or 503 at once (nothing fetched yet)
    1b. recall   what the embedding cache knows of the album (``recall``): an image it holds skips the rest
    2. fetch     URLs on greenlets (bounded pool), conditionally where the cache holds them; data: URLs and
                 uploads are already bytes
    3. decode    bytes → RGB → crop, in the decode thread pool (Pillow drops the GIL)
    4. infer     crop → micro-batcher → the one inference thread
    5. answer    rows → normalised embeddings / top-k labels / zero-shot scores / ranks, in request order,
                 with each stage's timing (``answers``)

Zero-shot labels and a rank query are embedded first (usually from the worker's cache: ``text_encoder``);
a texts-only request goes straight to the text tower (``run_texts``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import gevent
import gevent.pool
import numpy as np

from service.cache.entries import Outputs
from service.cache.tiers import EmbeddingCache
from service.engine.runner import Runner
from service.engine.scheduling import Admission
from service.engine.scheduling.rules import text_slots
from service.engine.types import EncodedJpeg, ModelInfo, Row
from service.errors import DeadlineExceeded, FetchDeadline, ImageError, ImagesFailed
from service.pipeline import answers
from service.pipeline.answers import Spans
from service.pipeline.device_decode import DeviceDecodeFailed
from service.pipeline.fetch import Fetched, Fetcher
from service.pipeline.prepare import checked_for_device, decode_and_crop
from service.pipeline.recall import CacheTally, Recall, model_id
from service.pipeline.requests import ImageRef, InferenceRequest
from service.pipeline.text_encoder import TextEncoder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rows:
    """``run_rows``' answer: the model that made the rows, one row per image in request order, timings."""

    info: ModelInfo
    rows: tuple[Row, ...]
    timings_ms: dict[str, float]


class Progress(Protocol):
    """Told of a request's progress as it happens (a streamed answer, ``service/http/streaming.py``): called
    in the request's greenlets, so it must not block."""

    def admitted(self) -> None: ...  # the request holds its queue slots: no 503 can come any more

    def item(self, item: dict[str, Any]) -> None: ...  # one image's (or text's) item: its answer, or its error


class _ImageFailed(Exception):
    """Thrown into the request's greenlet when one of its images failed and partial results are off."""


@dataclass
class _Work:
    """One request's work in progress, shared by its greenlets."""

    admission: Admission
    info: ModelInfo
    spans: Spans
    outcomes: dict[int, Row | ImageError]
    deadline: float
    request: gevent.Greenlet  # the greenlet running the request: ``abort`` interrupts it where it waits
    progress: Progress | None  # a streamed answer's; None: nobody listens, no item is built
    task: str
    req: InferenceRequest
    recall: Recall | None  # the embedding cache's part in this request; None with GREENSERVE_CACHE=off
    prompts: np.ndarray | None = None
    aborted: bool = False

    def settle(self, ref: ImageRef, outcome: Row | ImageError) -> None:
        """``ref``'s outcome, told to ``progress`` (if any) as its item at once."""
        self.outcomes[ref.index] = outcome
        if self.progress is not None:
            self.progress.item(answers.item(self.req, self.task, self.info, ref, outcome, self.prompts))

    def abort(self) -> None:
        """Once only: a second throw could land after the request has moved on to answering."""
        if not self.aborted:
            self.aborted = True
            gevent.kill(self.request, _ImageFailed())


class Orchestrator:
    def __init__(self, runner: Runner, fetcher: Fetcher, texts: TextEncoder, *, max_pixels: int,
                 on_image_error: Callable[[ImageError], None] | None = None,
                 cache: EmbeddingCache | None = None) -> None:
        self.runner = runner
        self.cache = cache
        self._model_id: tuple[ModelInfo, str] | None = None  # the loaded model's cache id, computed once
        self.fetcher = fetcher
        self.texts = texts
        self.max_pixels = max_pixels
        self.on_image_error = on_image_error

    def run(self, req: InferenceRequest, task: str, *, deadline: float, request_id: str = "", caller: str = "",
            progress: Progress | None = None, tally: CacheTally | None = None) -> dict[str, Any]:
        """The response body (without ``model``/``request_id``) for ``req``; raises request-level errors.
        ``caller`` shares the worker fairly with other callers; ``progress`` hears of each image's answer as
        soon as it is ready; ``tally`` hears what the embedding cache did.

        With ``partial`` false the first unusable image ends the request at once: its other fetches are
        cancelled, its decodes stopped and its queued images dropped before the model."""
        if req.text.texts:
            return self.run_texts(req, deadline=deadline, caller=caller, progress=progress)
        info, outcomes, spans, prompts = self._collect(req, task, deadline, request_id, caller, progress, tally)
        return answers.images(req, task, info, outcomes, self._report_failures(req, outcomes), spans, prompts)

    def run_rows(self, req: InferenceRequest, *, deadline: float, request_id: str = "", caller: str = "",
                 tally: CacheTally | None = None) -> Rows:
        """Each image's row (features and logits of one forward), in request order, for a protocol that
        encodes its own outputs (OIP v2 tensors). Any unusable image fails the whole request."""
        assert not req.partial and not req.text.texts and not req.text.prompts
        info, outcomes, spans, _ = self._collect(req, "embeddings", deadline, request_id, caller, None, tally)
        rows = tuple(row for ref in req.refs if isinstance(row := outcomes[ref.index], Row))
        assert len(rows) == len(req.refs)  # not partial: a failure raised ImagesFailed
        return Rows(info, rows, spans.timings(texts=False))

    def _collect(self, req: InferenceRequest, task: str, deadline: float, request_id: str, caller: str,
                 progress: Progress | None,
                 tally: CacheTally | None) -> tuple[ModelInfo, dict[int, Row | ImageError], Spans, np.ndarray | None]:
        spans = Spans()
        outcomes: dict[int, Row | ImageError] = {r.index: r.error for r in req.refs if r.error is not None}
        if outcomes and not req.partial:
            self._fail(req, outcomes)  # refused at parsing: no work is worth starting
        towers = ("image", "text") if req.text.prompts else ("image",)
        with self.runner.admit(len(req.refs), coming=len(req.refs) - len(outcomes), arrived=spans.started,
                               caller=caller, streamed=progress is not None, model=req.model, towers=towers,
                               deadline=deadline, urgency=req.urgency) as admission:
            info = self.runner.engine(req.model).info
            assert info is not None  # admitted: the model is ready
            if progress is not None:
                progress.admitted()
            work = _Work(admission, info, spans, outcomes, deadline, gevent.getcurrent(), progress, task, req,
                         self._recall(info, tally))
            for ref in req.refs:
                if ref.error is not None:  # refused at parsing (partial): its item goes first
                    work.settle(ref, ref.error)
            try:
                with _deadline_timeout(deadline, "images"):
                    if req.text.prompts:
                        t0 = time.monotonic()
                        work.prompts = self.texts.unit_vectors(req.text.prompts, deadline=deadline,
                                                               admission=admission)
                        spans.add("text", t0, time.monotonic())
                    self._process(req, work, request_id)
            except _ImageFailed:
                self._fail(req, outcomes)
            finally:  # what was computed is kept, whether or not the request still answers
                if work.recall is not None:
                    work.recall.flush()
        return info, outcomes, spans, work.prompts

    def run_texts(self, req: InferenceRequest, *, deadline: float, caller: str = "",
                  progress: Progress | None = None) -> dict[str, Any]:
        """Text embeddings: ``{"data": [{"index", "embedding", "tokens", "truncated"}], ...}``."""
        spans = Spans()
        texts = req.text.texts
        with self.runner.admit(text_slots(len(texts)), coming=0, arrived=spans.started, caller=caller,
                               model=req.model, towers=("text",), deadline=deadline, urgency=req.urgency) as admission:
            if progress is not None:
                progress.admitted()
            with _deadline_timeout(deadline, "texts"):
                rows = self.texts.encode(texts, deadline=deadline, admission=admission, truncate=req.text.truncate)
        body = answers.texts(req, rows, spans)
        if progress is not None:
            for item in body["data"]:  # one forward for them all: their items come together
                progress.item(item)
        return body

    def _recall(self, info: ModelInfo, tally: CacheTally | None) -> Recall | None:
        if self.cache is None:
            return None
        if self._model_id is None or self._model_id[0] is not info:
            self._model_id = (info, model_id(info))
        return Recall(self.cache, self._model_id[1], tally or CacheTally())

    def _process(self, req: InferenceRequest, work: _Work, request_id: str) -> None:
        group = gevent.pool.Group()
        try:
            remote = [r for r in req.refs if r.url is not None and r.error is None]
            if work.recall is not None:
                work.recall.prefetch([r.url for r in remote if r.url],
                                     {r.index: r.data for r in req.refs if r.data is not None})
                remote = self._fresh(req, remote, work, group)
            for ref in req.refs:
                if ref.data is not None:
                    group.spawn(self._image, req, ref, ref.data, work)
            if remote:
                self.runner.wait_to_fetch(work.admission)
                fetch_start = time.monotonic()
                urls = [r.url for r in remote if r.url is not None]  # all of them: mypy cannot see it
                validators = work.recall.validators(urls) if work.recall else None
                for i, result in self.fetcher.fetch_many(urls, deadline=work.deadline, request_id=request_id,
                                                         validators=validators):
                    work.spans.add("fetch", fetch_start, time.monotonic())
                    if isinstance(result, FetchDeadline):  # 504, as the deadline anywhere else; not 422
                        raise _deadline_passed("images")
                    group.spawn(self._image, req, remote[i], result, work)
            group.join(raise_error=True)
        finally:
            group.kill()

    def _fresh(self, req: InferenceRequest, remote: list[ImageRef], work: _Work,
               group: gevent.pool.Group) -> list[ImageRef]:
        """The URLs still to fetch: those inside their host's max-age are answered from the cache now."""
        assert work.recall is not None
        rest = []
        for ref in remote:
            outputs = work.recall.fresh(ref.url) if ref.url else None
            if outputs is None:
                rest.append(ref)
            else:
                group.spawn(self._recalled, ref, outputs, work)
        return rest

    @staticmethod
    def _recalled(ref: ImageRef, outputs: Outputs, work: _Work) -> None:
        with work.admission.image():
            work.settle(ref, Row(outputs.features, outputs.logits, 0.0, 0.0, 0))

    def _image(self, req: InferenceRequest, ref: ImageRef, got: bytes | Fetched | ImageError, work: _Work) -> None:
        """One image from its bytes (or its fetch's failure) to its row: from the cache when it knows them."""
        data = got.data if isinstance(got, Fetched) else got
        with work.admission.image():  # settles it, whatever happens, when it reaches the batcher
            known = None if work.recall is None or isinstance(got, ImageError) else work.recall.recall(ref.index, ref.url, got)
            if known is not None:
                return work.settle(ref, Row(known.features, known.logits, 0.0, 0.0, 0))
            try:
                pixels = self._decode(ref, data, work)
            except ImageError as err:
                return self._unusable(req, ref, err, work)
            result = self.runner.infer(pixels, work.deadline, work.admission)  # no yield before the exit
        try:
            row: Row = result.get()
        except DeviceDecodeFailed as failure:  # rare: Pillow decodes it, and names what is wrong if anything
            log.info("image %d of a request: %s; decoding it with Pillow", ref.index, failure)
            try:
                pixels = self._decode(ref, data, work, pillow=True)
            except ImageError as err:
                return self._unusable(req, ref, err, work)
            row = self.runner.infer(pixels, work.deadline, work.admission).get()
        work.settle(ref, row)
        if work.recall is not None:
            work.recall.keep(ref.index, Outputs(row.features, row.logits))
        end = time.monotonic()
        work.spans.add("queue", end - row.inference_s - row.queue_s, end - row.inference_s)
        work.spans.add("inference", end - row.inference_s, end)

    @staticmethod
    def _unusable(req: InferenceRequest, ref: ImageRef, err: ImageError, work: _Work) -> None:
        work.settle(ref, err)
        if not req.partial:
            work.abort()

    def _decode(self, ref: ImageRef, data: bytes | ImageError | None, work: _Work, *,
                pillow: bool = False) -> np.ndarray | EncodedJpeg:
        if isinstance(data, ImageError):  # the fetch failed
            raise data
        assert data is not None  # a 304 came only for an entry in hand
        t0 = time.monotonic()
        decode = checked_for_device if work.info.jpeg_decode == "device" and not pillow else decode_and_crop
        try:
            return self.runner.decode(decode, data, work.info.transform, self.max_pixels, admission=work.admission,
                                      index=ref.index)
        finally:
            work.spans.add("decode", t0, time.monotonic())

    def _fail(self, req: InferenceRequest, outcomes: dict[int, Row | ImageError]) -> None:
        raise ImagesFailed(self._report_failures(req, outcomes))

    def _report_failures(self, req: InferenceRequest,
                         outcomes: dict[int, Row | ImageError]) -> list[tuple[int, str, ImageError]]:
        """The request's unusable images, in request order, each counted once (``on_image_error``)."""
        failures = [(r.index, r.name, err) for r in req.refs if isinstance(err := outcomes.get(r.index), ImageError)]
        for _, _, err in failures:
            if self.on_image_error:
                self.on_image_error(err)
        return failures


def _deadline_timeout(deadline: float, what: str) -> gevent.Timeout:
    """Raises ``DeadlineExceeded`` in the request's greenlet where it waits, once ``deadline`` passes."""
    return gevent.Timeout(max(0.0, deadline - time.monotonic()), _deadline_passed(what))


def _deadline_passed(what: str) -> DeadlineExceeded:
    return DeadlineExceeded(f"the request deadline passed; retry with fewer {what} or a longer X-Request-Timeout")
