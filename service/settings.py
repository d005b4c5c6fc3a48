"""Settings: one frozen object read once from ``GREENSERVE_*`` environment variables.

A field's variable is GREENSERVE_ and its name in upper case; its metadata carries its section, unit, range and
one-line doc, so the README's tables (``settings_docs``), the validation messages and the defaults come from one
place.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from service.settings_parse import SettingsError, check_allow_entry, check_callers, check_http_url, check_int8, parse, range_text

__all__ = ["SECTIONS", "TUNING", "Settings", "SettingsError", "default_workers", "env_name"]

ENV_PREFIX = "GREENSERVE_"
WEIGHTS_MODES = ("auto", "imagenet", "random")
DTYPES = ("auto", "float32", "bfloat16", "float16")
CPU_BF16_MODES = ("auto", "yes", "no")
RUNTIMES = ("auto", "openvino", "torch")
LOG_LEVELS, LOG_FORMATS = ("debug", "info", "warning", "error"), ("text", "json")
JPEG_DECODE_MODES = ("auto", "pillow", "device")
CACHE_MODES = ("off", "memory", "disk")
_DEVICE_RE = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")
_TAG_RE = re.compile(r"^[A-Za-z0-9][\w.-]*$")  # open_clip pretrained tags: laion2b_s34b_b79k, openai


# torch threads a ViT (open_clip) worker gets by default, so GREENSERVE_WORKERS defaults to a worker per that many
# cores: one wider worker answers a burst's albums in order where narrow ones answer them side by side and all
# late (docs/SIZING.md#workers-and-threads; the runs: docs/history/clip-vit-b32.md)
VIT_THREADS = 2


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


CALLER_SOURCES = ("token", "address")  # what the server can check; a self-declared id only when listed
ALL_CALLER_SOURCES = ("token", "header", "forwarded", "address")

# What a setting is about, in the README's order. Tuning holds the switches that exist to turn a mechanism off
# and measure what it buys: they are listed in docs/SIZING.md#tuning, not among the README's groups.
TUNING = "Tuning"
SECTIONS = ("Server", "Model", "Fetching", "Limits", "Cache", "Connections", "Sharing", "Logging", TUNING)


def _setting(default: Any, doc: str, *, section: str, unit: str = "", parse: str = "str", lo: float | None = None,
             hi: float | None = None, factory: Callable[[], Any] | None = None) -> Any:
    if section not in SECTIONS:
        raise ValueError(f"section {section!r} is not one of {', '.join(SECTIONS)}")
    meta = {"doc": doc, "section": section, "unit": unit, "parse": parse, "lo": lo, "hi": hi}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Settings:
    """Everything the server can be told. Build directly in tests; ``from_env()`` in production."""

    bind: str = _setting("127.0.0.1:8000", "gunicorn listen address (host:port or unix:/path)", section="Server")
    workers: int = _setting(None, "gunicorn worker processes, each with its own model; unset: one per core, and for an open_clip "
                            "model (a ViT) one per 2 cores, each on 2 threads (measured faster for 5 albums at once on 2 cores: "
                            "docs/BENCHMARKS.md)", section="Server", parse="int", lo=1, hi=256, factory=_cpu_count)
    torch_threads: int = _setting(0, "torch intra-op threads per worker; 0 = cores // workers (at least 1)", section="Server",
                                  parse="int", lo=0, hi=256)
    decode_threads: int = _setting(0, "native threads per worker for decode + preprocess; 0 = max(2, cores // workers)",
                                   section="Server", parse="int", lo=0, hi=64)
    worker_timeout_s: int = _setting(120, "gunicorn worker timeout (a hub silent this long is killed)", section="Server",
                                     unit="s", parse="int", lo=10)
    graceful_timeout_s: int = _setting(30, "gunicorn graceful shutdown time for in-flight requests", section="Server", unit="s",
                                       parse="int", lo=1)
    api_token: str = _setting("", "bearer token required when set on every protocol's inference and metadata routes, never on "
                              "health routes (empty = no auth); several, comma-separated: each is a caller of its own",
                              section="Server")
    immich_upstream: str = _setting("", "immich's own ML service (http://immich-machine-learning:3003), where POST /predict "
                                    "forwards faces and OCR; empty: those are 501 (docs/PROTOCOLS.md#immich)", section="Server")

    model: str = _setting("resnet50", "the model: a torchvision classifier (resnet50, torchvision:convnext_tiny) or an open_clip "
                          "architecture (open_clip:ViT-B-32, image and text towers) or a timm backbone (timm:convnext_tiny); see "
                          "the README's model families", section="Model")
    weights: str = _setting("auto", "auto | imagenet | random | a file (state dict, TorchScript, open_clip checkpoint) | an "
                            "open_clip pretrained tag in the local cache (laion2b_s34b_b79k)", section="Model")
    max_resident_towers: int = _setting(0, "towers a worker keeps in memory across its models; past it, the least recently "
                                        "used one not pinned is unloaded first (0 = no cap)", section="Model", parse="int", lo=0)
    models: str = _setting("", "several models: name=model[@weights], comma-separated, the default first (replaces "
                           "GREENSERVE_MODEL; each weights default GREENSERVE_WEIGHTS)", section="Model")
    device: str = _setting("auto", "cpu | cuda | cuda:N | auto (cuda when present, workers spread over GPUs)", section="Model")
    dtype: str = _setting("auto", "auto | float32 | bfloat16 | float16: the forward's dtype. auto: each tower tries bfloat16 on "
                          "a CPU with AMX or avx512_bf16 or a GPU of compute capability 8+ (float16 on 7.x), with its weights "
                          "cast once and by autocast, and keeps the faster that agrees with float32 (cosine >= 0.9999, same "
                          "top-1) and is >= 1.15x as fast at the batch sizes it forms, else float32; /v1/models says which and "
                          "why. The others pin it (weights cast once)", section="Model")
    cpu_bf16: str = _setting("auto", "auto | yes | no: whether dtype auto treats this CPU as running bfloat16 natively (auto: "
                             "the amx_bf16 or avx512_bf16 CPU flag; yes where a VM hides the flags)", section="Model")
    runtimes: str = _setting("auto", "auto | openvino | torch: with dtype auto on a CPU, auto also tries an image tower in "
                             "OpenVINO by the same rules, unless its model has a text tower (a converted forward has no "
                             "preemption points for searches); openvino: every image tower", section="Model")
    int8: str = _setting("off", "off | allow | a minimum cosine: the trial may try an OpenVINO image tower in int8 (NNCF: pip "
                         "install greenserve[int8]), kept at cosine >= 0.999 (allow) or as given, and top-1", section="Model")
    jpeg_decode: str = _setting("auto", "auto | pillow | device: where JPEGs are decoded. device: in batches on the model's "
                                "device in its inference thread (nvJPEG on CUDA), resized and cropped there, Pillow for other "
                                "formats and any JPEG it cannot decode; auto = device on CUDA, pillow on CPU", section="Model")
    channels_last: bool = _setting(True, "run convnets in channels_last memory format (faster on CPU; converting a plain state "
                                   "dict copies the weights into each worker: `greenserve export` writes them converted)",
                                   section="Model", parse="bool")
    max_batch: int = _setting(32, "images per forward pass", section="Model", parse="int", lo=1, hi=4096)
    max_batch_wait_ms: float = _setting(40.0, "how long a non-full batch waits for more images on their way (docs/SCHEDULING.md"
                                        "#gather)", section="Model", unit="ms", parse="float", lo=0, hi=1000)
    max_text_batch: int = _setting(64, "texts per text forward pass", section="Model", parse="int", lo=1, hi=4096)

    image_base_url: str = _setting("", "base URL that relative image names are resolved against", section="Fetching")
    fetch_allow: tuple[str, ...] = _setting((), "comma-separated origins (http://10.0.0.5:9000) and/or CIDRs the fetcher may "
                                            "reach even though they are not public", section="Fetching", parse="list",
                                            factory=tuple)
    fetch_concurrency: int = _setting(16, "concurrent fetches per request; a request starts fetching once the worker's earlier "
                                      "requests have at most this many images on their way", section="Fetching", parse="int",
                                      lo=1, hi=256)
    fetch_worker_concurrency: int = _setting(64, "concurrent fetches per worker, all its requests together (also the idle "
                                             "keep-alive connections kept per host)", section="Fetching", parse="int", lo=1,
                                             hi=4096)
    fetch_connect_timeout_s: float = _setting(3.0, "connect timeout per fetch", section="Fetching", unit="s", parse="float",
                                              lo=0.05, hi=120)
    fetch_timeout_s: float = _setting(10.0, "total deadline per fetched image (all retries included)", section="Fetching",
                                      unit="s", parse="float", lo=0.1, hi=600)
    fetch_max_redirects: int = _setting(3, "redirects followed per image", section="Fetching", parse="int", lo=0, hi=20)
    fetch_retries: int = _setting(2, "retries per image for connect errors and 429/502/503/504", section="Fetching", parse="int",
                                  lo=0, hi=10)

    max_images: int = _setting(64, "images per request", section="Limits", parse="int", lo=1, hi=10_000)
    max_image_bytes: int = _setting(20 * 1024 * 1024, "bytes per image (fetched, uploaded or data: URL)", section="Limits",
                                    unit="bytes", parse="int", lo=1024)
    max_image_pixels: int = _setting(40_000_000, "pixels per decoded image (width x height)", section="Limits", unit="pixels",
                                     parse="int", lo=1)
    max_body_bytes: int = _setting(64 * 1024 * 1024, "request body size", section="Limits", unit="bytes", parse="int", lo=1024)
    max_texts: int = _setting(1024, "texts per request (text embeddings); LangChain's OpenAIEmbeddings sends 1,000 per call by "
                              "default", section="Limits", parse="int", lo=1, hi=100_000)
    max_text_chars: int = _setting(2000, "characters per text, query, label or template", section="Limits", parse="int", lo=1,
                                   hi=1_000_000)
    max_labels: int = _setting(1000, "labels per zero-shot classify request", section="Limits", parse="int", lo=1, hi=100_000)
    max_text_tokens: int = _setting(16_384, "tokens a request's texts (its texts, or its labels in their template) send "
                                    "through the text tower, summed; texts already in the worker's cache do not count",
                                    section="Limits", parse="int", lo=77, hi=10_000_000)
    max_top_k: int = _setting(100, "largest top_k a caller may ask for", section="Limits", parse="int", lo=1, hi=100_000)
    max_queue_images: int = _setting(256, "images admitted per worker (queued or running) before 503", section="Limits",
                                     parse="int", lo=1)
    request_timeout_s: float = _setting(60.0, "request deadline (a per-request X-Request-Timeout header may shorten it)",
                                        section="Limits", unit="s", parse="float", lo=0.1, hi=3600)

    cache: str = _setting("disk", "off | memory | disk | redis://host:6379/0: where image embeddings are kept by content "
                          "(docs/CACHE.md). disk: one sqlite file shared by the host's workers, which an album re-sync and a "
                          "restart both find; memory: each worker's own; redis: a fleet's", section="Cache")
    cache_dir: str = _setting("", "directory of the disk cache; empty: $XDG_CACHE_HOME/greenserve (~/.cache/greenserve)",
                              section="Cache")
    cache_memory_mb: int = _setting(64, "memory each worker keeps for recent entries (LRU), in front of disk or redis; 0: none",
                                    section="Cache", unit="MB", parse="int", lo=0, hi=1_000_000)
    cache_disk_mb: int = _setting(1024, "size cap of the disk cache, its sqlite file and WAL together (least recently used "
                                  "entries go first)", section="Cache", unit="MB", parse="int", lo=1, hi=10_000_000)
    cache_ttl_s: int = _setting(30 * 86400, "how long an entry lives in the disk cache or redis; 0: until evicted",
                                section="Cache", unit="s", parse="int", lo=0, hi=10 * 365 * 86400)
    cache_timeout_ms: float = _setting(100.0, "the longest one cache call may wait for disk or redis before the request goes on "
                                       "without the cache", section="Cache", unit="ms", parse="float", lo=1, hi=10_000)
    label_cache_size: int = _setting(4096, "text embeddings of labels and queries each worker keeps (LRU), so a repeated label "
                                     "set costs no text forward; 0: none", section="Cache", parse="int", lo=0, hi=10_000_000)

    worker_connections: int = _setting(1000, "connections one worker holds at once (gunicorn worker_connections), requests in "
                                       "progress and idle ones together", section="Connections", parse="int", lo=2, hi=100_000)
    max_idle_connections: int = _setting(512, "connections per worker waiting for a request (new or kept alive); past it the "
                                         "longest-waiting one is closed, so idle or slow clients cannot fill the worker",
                                         section="Connections", parse="int", lo=1, hi=100_000)
    keepalive_s: int = _setting(5, "how long a connection may wait for its next request, and how long a request's line and "
                                "headers may take to arrive", section="Connections", unit="s", parse="int", lo=1, hi=3600)
    body_timeout_s: float = _setting(30.0, "how long a request body may take to arrive whole (408 and the connection closed "
                                     "after it), so a stalled client cannot hold a worker's connection", section="Connections",
                                     unit="s", parse="float", lo=0.1, hi=3600)
    stream_heartbeat_s: float = _setting(15.0, "how often a text/event-stream answer sends a comment line while no image is "
                                         "ready", section="Connections", unit="s", parse="float", lo=0.1, hi=300)

    caller_from: tuple[str, ...] = _setting(CALLER_SOURCES, "who a caller is, for fair sharing and GREENSERVE_MAX_CALLER_IMAGES: "
                                            "the first of token (one of GREENSERVE_API_TOKEN's), forwarded (X-Real-IP or the "
                                            "last X-Forwarded-For address, from GREENSERVE_TRUSTED_PROXIES only), address (the "
                                            "peer's IP) the request has; header: X-Client-ID, within that caller "
                                            "(docs/SCHEDULING.md#share)", section="Sharing", parse="list",
                                            factory=lambda: CALLER_SOURCES)
    trusted_proxies: tuple[str, ...] = _setting((), "comma-separated addresses or CIDRs of the proxies whose X-Real-IP / "
                                                "X-Forwarded-For name the caller (the shipped nginx: 127.0.0.1)",
                                                section="Sharing", parse="list")
    max_caller_images: int = _setting(0, "images one caller may have admitted (queued or running) per worker before 429 + "
                                      "Retry-After; 0 = no cap of its own (callers are still interleaved)", section="Sharing",
                                      parse="int", lo=0)
    fair_quantum_ms: float = _setting(250.0, "while callers share a worker, a forward that cannot be interrupted (a TorchScript "
                                      "model, or GREENSERVE_PREEMPT_FORWARDS=false) holds about this much work (at least one "
                                      "image): another caller's image waits for one short forward, not an album's",
                                      section="Sharing", unit="ms", parse="float", lo=1, hi=60_000)

    log_level: str = _setting("info", "debug | info | warning | error", section="Logging")
    log_format: str = _setting("text", "text | json (one JSON object per line: the access lines with request id, route, status, "
                               "images, stage timings, pid and bytes; errors with code and request id)", section="Logging")

    # Each Tuning doc says what the mechanism does, what false (or 0) leaves instead, and what that is for.
    batch_across_requests: bool = _setting(True, "concurrent requests' images share a forward once nothing of theirs is on its "
                                           "way; false: one request per forward, the baseline batching across requests is "
                                           "measured against (docs/SCHEDULING.md#own-batch)", section=TUNING, parse="bool")
    borrow_idle_cores: bool = _setting(True, "on CPU, a worker whose siblings are all idle runs torch on every core, else on its "
                                       "share (cores // workers); false: always its share, to measure what borrowing buys "
                                       "(bench/probes/borrow_bench.py). GREENSERVE_TORCH_THREADS pins the count, which also "
                                       "turns borrowing off", section=TUNING, parse="bool")
    preempt_forwards: bool = _setting(True, "another caller's images run between the blocks of a running forward (at most as "
                                      "many as it holds), and light callers' complete requests while a batch gathers; false: "
                                      "they wait for the forward, which GREENSERVE_FAIR_QUANTUM_MS keeps short as for a "
                                      "TorchScript model, to measure the interjection (docs/SCHEDULING.md#interject)",
                                      section=TUNING, parse="bool")
    compute_nice: int = _setting(10, "niceness added to each worker's decode threads, half of it to its inference thread "
                                 "(Linux): on saturated cores the thread that answers HTTP and health checks runs first, then "
                                 "the model, then decode; 0: every thread at the hub's priority, to measure what that order buys "
                                 "(docs/SCHEDULING.md#priorities)", section=TUNING, parse="int", lo=0, hi=19)
    accept_gate: bool = _setting(True, "a worker stops accepting connections while a sibling has less load (requests in flight "
                                 "plus connections accepted whose first request has not started), so concurrent requests spread "
                                 "over the workers; false: each worker accepts as plain gunicorn's does, to measure the gate "
                                 "(bench/probes/engine_bench.py)", section=TUNING, parse="bool")
    rebalance_connections: bool = _setting(True, "a worker that keeps more than one keep-alive connection more than a sibling "
                                           "closes one after its response, so the client reconnects to the lighter worker (after "
                                           "a respawn, say); false: kept connections stay where they are, to measure the "
                                           "rebalancing (docs/SCHEDULING.md#connections)", section=TUNING, parse="bool")
    cancel_on_disconnect: bool = _setting(True, "a request whose client disconnects stops its remaining work (the batch already "
                                          "running finishes); false: every image is still inferred, the control that shows what "
                                          "cancelling saves (tests/e2e/test_e2e_streaming.py)", section=TUNING, parse="bool")

    # ------------------------------------------------------------------ derived values

    def torch_threads_per_worker(self, cores: int | None = None) -> int:
        """Threads for torch: explicit, else this worker's share of the cores."""
        if self.torch_threads:
            return self.torch_threads
        return max(1, (cores or _cpu_count()) // self.workers)

    def caller_share(self) -> int:
        """Images one caller may have admitted on a worker."""
        return self.max_caller_images or self.max_queue_images

    def decode_threads_per_worker(self, cores: int | None = None) -> int:
        """Explicit, else this worker's share of the cores, at least 2 (decode overlaps inference)."""
        return self.decode_threads or max(2, (cores or _cpu_count()) // self.workers)

    def cache_directory(self) -> str:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return self.cache_dir or os.path.join(base, "greenserve")

    @property
    def base_origin(self) -> str | None:
        if not self.image_base_url:
            return None
        parts = urlsplit(self.image_base_url)
        return f"{parts.scheme}://{parts.netloc}".lower()

    # ------------------------------------------------------------------ construction

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            lo, hi = f.metadata["lo"], f.metadata["hi"]
            if lo is not None and value < lo or hi is not None and value > hi:
                raise SettingsError(f"{env_name(f.name)}={value!r} is out of range; allowed "
                                    f"{range_text(lo, hi)}")
        check_callers(self.caller_from, ALL_CALLER_SOURCES, self.trusted_proxies)
        if not _DEVICE_RE.match(self.device):
            raise SettingsError(f"GREENSERVE_DEVICE={self.device!r} is not one of cpu, cuda, cuda:N, auto")
        if self.weights in ("", None):
            raise SettingsError("GREENSERVE_WEIGHTS is empty; use auto, imagenet, random or a file path")
        if self.weights not in WEIGHTS_MODES and not os.path.isfile(self.weights) and not (
                self.model.startswith("open_clip:") and _TAG_RE.match(self.weights)):
            raise SettingsError(f"GREENSERVE_WEIGHTS={self.weights!r} is neither auto/imagenet/random, an "
                                "existing file, nor (for an open_clip model) a pretrained tag")
        check_http_url("GREENSERVE_IMAGE_BASE_URL", self.image_base_url)
        check_http_url("GREENSERVE_IMMICH_UPSTREAM", self.immich_upstream)
        for entry in self.fetch_allow:
            check_allow_entry(entry)
        for name, value, allowed in (("dtype", self.dtype, DTYPES), ("jpeg_decode", self.jpeg_decode, JPEG_DECODE_MODES),
                                     ("runtimes", self.runtimes, RUNTIMES), ("cpu_bf16", self.cpu_bf16, CPU_BF16_MODES),
                                     ("log_level", self.log_level, LOG_LEVELS), ("log_format", self.log_format, LOG_FORMATS)):
            if value not in allowed:
                raise SettingsError(f"{env_name(name)}={value!r} is not one of {', '.join(allowed)}")
        check_int8(self.int8)
        if self.max_idle_connections >= self.worker_connections:
            raise SettingsError(f"GREENSERVE_MAX_IDLE_CONNECTIONS={self.max_idle_connections} must be below "
                                f"GREENSERVE_WORKER_CONNECTIONS={self.worker_connections}, or idle connections "
                                "could fill the worker")
        if self.cache not in CACHE_MODES and not self.cache.startswith(("redis://", "rediss://", "unix://")):
            raise SettingsError(f"GREENSERVE_CACHE={self.cache!r} is not one of {', '.join(CACHE_MODES)} or a "
                                "redis://host:port/db URL")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read, cast and validate every GREENSERVE_* variable; unknown GREENSERVE_* names are errors."""
        environ = os.environ if environ is None else environ
        known = {env_name(f.name): f for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in known)
        if unknown:
            raise SettingsError(f"unknown setting(s) {', '.join(unknown)}; see the README's settings table")
        values = {}
        for name, f in known.items():
            if name in environ:
                values[f.name] = parse(name, environ[name], f.metadata["parse"])
        if "workers" not in values:
            values["workers"] = default_workers(str(values.get("model", cls.model)), _cpu_count())
        return cls(**values)

    def describe(self) -> dict[str, Any]:
        """Values for the start-up log line (the token is masked)."""
        out = dataclasses.asdict(self)
        return {**out, "api_token": "***"} if out["api_token"] else out


def default_workers(model: str, cores: int) -> int:
    """GREENSERVE_WORKERS when unset: a worker per core, and per ``VIT_THREADS`` cores for a ViT (open_clip)."""
    return max(1, cores // VIT_THREADS) if model.startswith("open_clip:") else cores


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()
