"""Streamed answers: each image's line as soon as its row is ready, then a last line with the rest.

The words: a *row* is the model's output for one image (the engine's word: a streamed answer's first row
goes through the model alone, ``rules.first_row``); an *item* is that image's answer, as in the JSON
answer's ``data``; a *line* is what the client reads, an item or the last line. The first row comes out as
the first line.

    NDJSON (``Accept: application/x-ndjson``)   one JSON object per line
    SSE    (``Accept: text/event-stream``)      ``event: <kind>`` + ``data: <the same JSON>``; a comment line
                                               every GREENSERVE_STREAM_HEARTBEAT_S while nothing is ready

Lines, in completion order (each carries its ``index``):

    {"event": "item", "index", "image", <its result as in "data"> | "error": {"code", "message"}}
    {"event": "done", "model", "errors", "timings_ms", "request_id"}    (rank: also "data", best first)
    {"event": "failed", "status", "error": {...}, "request_id"}         (the request failed after its start)

The request runs in its own greenlet and puts each image's item on a queue (``orchestrate.Progress``);
the response's iterator waits on that queue: event-driven, no polling. ``start`` returns once the request
is admitted, so a 503, a 400 or a refusal at parsing is still an ordinary error answer. A client that
leaves (the next write fails, or its socket closes) stops what is left, as for an answer not streamed.
Each line's write is bounded by the request's deadline (``connection.SendBound``): a client that stops
reading is cut off there, where its work ends too; meanwhile the worker holds its lines (one request's
items at most: gunicorn reads the connection's next request only once this answer is written).
No Flask here: ``current.stream`` wraps the iterator in a response.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import gevent
import gevent.event
import gevent.queue
import orjson

from service.errors import ClientGone, GreenserveError
from service.http.connection import SendBound
from service.http.context import RequestContext
from service.http.dataplane import DataPlane, Served
from service.pipeline.requests import InferenceRequest

log = logging.getLogger(__name__)
NDJSON = "application/x-ndjson"
SSE = "text/event-stream"
FORMATS = (NDJSON, SSE)
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # nginx: pass each line on at once
_END = object()


@dataclass
class _Lines:
    """The request's ``Progress``: its answers queued for the response's iterator."""

    queue: gevent.queue.Queue = field(default_factory=gevent.queue.Queue)
    ready: gevent.event.Event = field(default_factory=gevent.event.Event)

    def admitted(self) -> None:
        self.ready.set()

    def item(self, item: dict[str, Any]) -> None:
        self.queue.put({"event": "item", **item})


@dataclass
class Stream:
    """A started request: iterate ``lines()`` for the encoded lines; ``served()`` once it has ended."""

    media_type: str
    heartbeat_s: float
    request_id: str
    keep_data: bool  # rank: the last line has the ranking
    cancel: bool  # GREENSERVE_CANCEL_ON_DISCONNECT: a client that leaves stops the work left
    send: SendBound  # each line's write ends by the request's deadline
    _lines: _Lines
    _work: gevent.Greenlet

    def lines(self) -> Iterator[bytes]:
        try:
            for line in self._encoded():
                self.send.arm()
                yield line
            self.send.arm()  # the closing chunk, which gunicorn writes after the last line
        finally:  # the client left (a write failed or passed its bound) or the answer is complete
            if self.cancel and not self._work.dead:
                self._work.kill(ClientGone("the client left during the streamed answer"), block=False)

    def _encoded(self) -> Iterator[bytes]:
        while True:
            try:
                got = self._lines.queue.get(timeout=self.heartbeat_s if self.media_type == SSE else None)
            except gevent.queue.Empty:
                yield b": waiting\n\n"  # keeps proxies from timing the stream out; tells a gone client
                continue
            if got is _END:
                break
            yield self._encode(got)
        yield self._encode(self._last())

    def served(self) -> Served | None:
        """What the access line says of the work, once the request's greenlet has ended."""
        return self._work.value[1] if self._work.successful() else None

    def _last(self) -> dict[str, Any]:
        outcome, _ = self._work.get()
        if isinstance(outcome, GreenserveError):
            return {"event": "failed", "status": outcome.status_code, "error": outcome.to_dict(),
                    "request_id": self.request_id}
        return {"event": "done", **{k: v for k, v in outcome.items() if k != "data" or self.keep_data}}

    def _encode(self, doc: dict[str, Any]) -> bytes:
        data = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
        if self.media_type == SSE:
            return b"event: " + str(doc["event"]).encode() + b"\ndata: " + data + b"\n\n"
        return data + b"\n"


def start(plane: DataPlane, ctx: RequestContext, req: InferenceRequest, task: str, media_type: str) -> Stream:
    """Run ``req`` in its own greenlet; return once it holds its queue slots. What fails before that
    (not ready, overloaded, a refused image with ``partial`` false) raises here."""
    lines = _Lines()  # ``DataPlane.run`` checks the task first: a refusal ends the greenlet before admission
    work = gevent.spawn(_run, plane, ctx, req, task, lines)
    gevent.wait([lines.ready, work], count=1)
    if not lines.ready.is_set():  # it ended before admission: only by failing
        outcome, _ = work.get()
        assert isinstance(outcome, GreenserveError)
        raise outcome
    send = SendBound(ctx.client, ctx.deadline(plane.settings.request_timeout_s), time.monotonic())
    return Stream(media_type, plane.settings.stream_heartbeat_s, ctx.request_id, task == "rank",
                  plane.settings.cancel_on_disconnect, send, lines, work)


def _run(plane: DataPlane, ctx: RequestContext, req: InferenceRequest, task: str,
         lines: _Lines) -> tuple[dict[str, Any] | GreenserveError, Served]:
    """The request's greenlet: its answer, or its failure as a value (a greenlet's exception would only be
    printed by gevent); then the queue's end, whatever happens."""
    try:
        with plane.busy():  # siblings see this worker busy until the stream's work is done
            answer = plane.run(ctx, req, task, progress=lines)
        return answer.body, answer.served
    except GreenserveError as err:
        return err, Served.sized(req)
    except Exception:  # a bug: logged with the request id, and the stream's last line says so
        log.exception("request_id=%s unhandled error in a streamed answer", ctx.request_id,
                      extra={"request_id": ctx.request_id, "code": "internal_error"})
        return GreenserveError("internal error; report the request id"), Served.sized(req)
    finally:
        lines.queue.put(_END)
