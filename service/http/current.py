"""What the routes take from Flask, in one place: the app's data plane, this request's context, the access
line's facts and a JSON response. The data plane gets the context as an argument."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import orjson
from flask import Response, current_app, g, request, stream_with_context

from service.http import streaming
from service.http.context import RequestContext
from service.http.dataplane import DataPlane, Served
from service.pipeline.orchestrate import Rows
from service.pipeline.requests import InferenceRequest

EXTENSION = "greenserve"  # the app's data plane, in ``app.extensions`` (``create_app`` puts it there)


def plane() -> DataPlane:
    return cast(DataPlane, current_app.extensions[EXTENSION])


def context() -> RequestContext:
    return cast(RequestContext, g.context)  # set by hooks when the request starts


def context_or_none() -> RequestContext | None:
    """None only for a request that failed before its context was built."""
    return cast(RequestContext | None, g.get("context"))


@contextmanager
def busy() -> Iterator[DataPlane]:
    """The data plane, around parsing and running: siblings see this worker as busy from here."""
    the_plane = plane()
    with the_plane.busy():
        yield the_plane


def run(req: InferenceRequest, task: str, *, timeout_s: float | None = None) -> dict[str, Any]:
    """The data plane's answer to this request, its work noted for the access line (its size first: a
    request that fails still says how many images it had)."""
    note(Served.sized(req))
    answer = plane().run(context(), req, task, timeout_s=timeout_s)
    note(answer.served)
    return answer.body


def run_rows(req: InferenceRequest, tasks: tuple[str, ...], *, timeout_s: float | None = None) -> Rows:
    note(Served.sized(req))
    rows, work = plane().run_rows(context(), req, tasks, timeout_s=timeout_s)
    note(work)
    return rows


def streamed_format() -> str | None:
    """The stream format the client asks for (``Accept``), None for a JSON answer: a client that accepts
    anything (``*/*``) or prefers JSON gets JSON."""
    best = request.accept_mimetypes.best_match(["application/json", *streaming.FORMATS])
    return best if best in streaming.FORMATS else None


def stream(req: InferenceRequest, task: str, media_type: str) -> Response:
    """A streamed answer (``streaming``), started in its own greenlet; the access line waits for its end."""
    note(Served.sized(req))
    started = streaming.start(plane(), context(), req, task, media_type)
    g.stream = started
    return Response(stream_with_context(started.lines()), mimetype=media_type, headers=streaming.HEADERS)


def stream_or_none() -> streaming.Stream | None:
    return cast(streaming.Stream | None, g.get("stream"))


def note(served: Served) -> None:
    """What the access line says of the work (images, stage timings)."""
    g.served = served


def served() -> Served | None:
    return cast(Served | None, g.get("served"))


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    # orjson, on the hub: fast enough for the largest answer, which json.dumps of Python float lists had to
    # offload (docs/SCHEDULING.md#hub-turns)
    return Response(orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), status=status, headers=headers,
                    mimetype="application/json")
