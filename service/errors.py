"""The error tree. Every failure a caller can cause or see is one of these; one handler maps them to HTTP.

    GreenserveError (500 internal_error; http_error for another framework status)
    ├── RequestError (400)            invalid_request, invalid_json, malformed_body, task_not_supported,
    │   │                             empty_text, over_context_length, text_not_supported,
    │   │                             labels_required, labels_not_supported, dimensions_not_supported,
    │   │                             token_input_not_supported, invalid_tensor, unexpected_output,
    │   │                             duplicate_output, json_too_deep, unnamed_form_part
    │   └── Unprocessable (422)       invalid_entries: immich's ``entries`` that do not parse (its ML service's 422)
    ├── Unauthorized (401)            unauthorized
    ├── NotFound (404)                not_found: no such route; model_not_found: no such model or version
    ├── MethodNotAllowed (405)        method_not_allowed
    ├── BodyTimeout (408)             body_timeout: the body did not arrive within GREENSERVE_BODY_TIMEOUT_S
    ├── PayloadTooLarge (413)         body_too_large, too_many_images, too_many_texts, text_too_long,
    │                                 too_many_labels, too_many_tokens, json_too_complex
    ├── UnsupportedMediaType (415)    unsupported_content_type, unsupported_content_encoding
    ├── ImageError (422)              invalid_data_url; one image is unusable, carried per image in
    │   │                             ``details`` / ``errors``
    │   ├── ImageTooLarge (413)       image_too_large (bytes or pixels)
    │   ├── UnsupportedImage (415)    unsupported_image_format
    │   ├── NotAnImage                not_an_image, empty_image, truncated_image, invalid_image,
    │   │                             invalid_base64
    │   └── FetchError                fetch_failed, fetch_timeout, url_not_allowed, invalid_url
    │       └── FetchDeadline         the request's deadline ended a fetch: the request answers 504
    ├── ImagesFailed (by its images)  the request failed because of its images (partial=false)
    ├── OverShare (429)               over_share: the caller has its share of the worker's queue; Retry-After
    ├── Overloaded (503)              overloaded, not_ready, model_unavailable (unloaded through the repository API); Retry-After
    │   └── OutOfMemory               out_of_memory: one image alone did not fit in the device's memory
    ├── NotServed (501)               task_not_served: an immich task (faces, OCR) with no GREENSERVE_IMMICH_UPSTREAM
    ├── UpstreamFailed (502)          upstream_unreachable, upstream_failed: GREENSERVE_IMMICH_UPSTREAM could not be
    │                                 reached, or answered more than GREENSERVE_MAX_BODY_BYTES
    ├── DeadlineExceeded (504)        deadline_exceeded; upstream_timeout: the upstream did not answer in time
    ├── ClientGone (499)              client_closed_request: the client disconnected; its work stopped
    └── InferenceFailed (500)         inference_failed: the model raised on a batch

Third-party exceptions are translated where they arise (``raise ... from exc``); views have no ``try``.
"""

from __future__ import annotations

from typing import Any


class GreenserveError(Exception):
    status_code = 500
    code = "internal_error"

    def __init__(self, message: str, *, code: str | None = None, details: list[dict[str, Any]] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.details = details or []
        self.headers = headers or {}

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "details": self.details}


class RequestError(GreenserveError):
    status_code = 400
    code = "invalid_request"


class Unprocessable(RequestError):
    status_code = 422
    code = "invalid_entries"


class Unauthorized(GreenserveError):
    status_code = 401
    code = "unauthorized"


class NotFound(GreenserveError):
    status_code = 404
    code = "not_found"


class MethodNotAllowed(GreenserveError):
    status_code = 405
    code = "method_not_allowed"


class BodyTimeout(GreenserveError):
    """The request body did not all arrive in time; the connection closes after the answer."""

    status_code = 408
    code = "body_timeout"


class PayloadTooLarge(GreenserveError):
    status_code = 413
    code = "body_too_large"


class UnsupportedMediaType(GreenserveError):
    status_code = 415
    code = "unsupported_content_type"


class ImageError(GreenserveError):
    """One image could not be used. The request fails with it (partial=false) or lists it (partial=true)."""

    status_code = 422
    code = "invalid_image"


class ImageTooLarge(ImageError):
    status_code = 413
    code = "image_too_large"


class UnsupportedImage(ImageError):
    status_code = 415
    code = "unsupported_image_format"


class NotAnImage(ImageError):
    code = "not_an_image"


class FetchError(ImageError):
    code = "fetch_failed"


class FetchDeadline(FetchError):
    """A fetch the request's deadline cut short (not GREENSERVE_FETCH_TIMEOUT_S): the orchestrator answers
    the request 504 ``deadline_exceeded``, as a deadline passing anywhere else does, never 422 for its image."""

    code = "fetch_timeout"


class ImagesFailed(GreenserveError):
    """Some images were unusable and the caller did not ask for partial results."""

    def __init__(self, failures: list[tuple[int, str, ImageError]]) -> None:
        statuses = {err.status_code for _, _, err in failures}
        _, first_name, first = failures[0]
        self.status_code = statuses.pop() if len(statuses) == 1 else 422
        details = [image_error_item(i, ref, err) for i, ref, err in failures]
        n = len(failures)
        message = (f"{n} image(s) could not be used; the first, {first_name}: {first.message}. Fix or drop them "
                   "(the native routes also take \"partial\": true to get results for the rest)")
        super().__init__(message, code=first.code, details=details)


class OverShare(GreenserveError):
    """The caller has its share of the worker's queue (the server itself may have room: that is 503)."""

    status_code = 429
    code = "over_share"

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, round(retry_after_s)))})
        self.retry_after_s = retry_after_s


class Overloaded(GreenserveError):
    status_code = 503
    code = "overloaded"

    def __init__(self, message: str, *, retry_after_s: float, code: str | None = None) -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(max(1, round(retry_after_s)))})
        self.retry_after_s = retry_after_s


class OutOfMemory(Overloaded):
    """The model's device ran out of memory. Raised by the model's forward once its memory is released; the
    batcher splits the batch and retries the halves, and only an image that fails alone answers this."""

    code = "out_of_memory"


class NotServed(GreenserveError):
    status_code = 501
    code = "task_not_served"


class UpstreamFailed(GreenserveError):
    status_code = 502
    code = "upstream_unreachable"


class DeadlineExceeded(GreenserveError):
    status_code = 504
    code = "deadline_exceeded"


class ClientGone(GreenserveError):
    """Thrown into a request whose client disconnected (nginx's 499): nobody reads the answer."""

    status_code = 499
    code = "client_closed_request"


class InferenceFailed(GreenserveError):
    status_code = 500
    code = "inference_failed"


_BY_STATUS: dict[int, type[GreenserveError]] = {
    400: RequestError, 401: Unauthorized, 404: NotFound, 405: MethodNotAllowed, 413: PayloadTooLarge,
    415: UnsupportedMediaType}


def from_http_status(status: int, message: str) -> GreenserveError:
    """The tree's error for an HTTP error raised by the framework (routing, body limits, bad framing)."""
    cls = _BY_STATUS.get(status)
    if cls is not None:
        return cls(message)
    err = GreenserveError(message, code="http_error")
    err.status_code = status
    return err


def image_error_item(index: int, image: str, err: ImageError) -> dict[str, Any]:
    """The per-image error object used in ``details`` (422) and ``errors`` (partial 200); a fetch
    failure from the image host also carries its ``upstream_status``."""
    item = {"index": index, "image": image, "code": err.code, "message": err.message}
    for extra in err.details:
        if "upstream_status" in extra:
            item["upstream_status"] = extra["upstream_status"]
    return item
