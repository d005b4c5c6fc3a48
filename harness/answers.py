"""Reading a real server's answers in tests: a metric from /metrics, the Cache-Status counts, an error's code in
any protocol's shape, and a streamed answer checked against the plain one."""

from __future__ import annotations

import re
from typing import Any

import requests

from harness.launch import GunicornServer


def metric_sum(text: str, name: str, labels: str = "") -> float:
    """The sum of ``name``'s samples in a /metrics text, over the series whose labels contain ``labels``."""
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*{re.escape(labels)}[^}}]*\}})?\s+([0-9.e+-]+)$", re.M)
    return sum(float(m.group(2)) for m in pattern.finditer(text))


def metric(srv: GunicornServer, name: str, labels: str = "") -> float:
    """``metric_sum`` of the server's /metrics now."""
    return metric_sum(requests.get(srv.url + "/metrics", timeout=10).text, name, labels)


def cache_counts(r: requests.Response) -> dict[str, str]:
    """The Cache-Status detail's counts: {"hit": "30", "miss": "0", ...}."""
    detail = r.headers["Cache-Status"].split('detail="')[1].rstrip('"')
    return dict(part.split("=") for part in detail.split())


def code_of(response: requests.Response) -> str:
    """An error answer's stable code, in whichever protocol's shape it came."""
    body = response.json()
    if isinstance(body.get("error"), dict):  # native / OpenAI
        return body["error"]["code"]
    return body.get("error_code") or body["code"]  # TorchServe / OIP and KServe v1


def same_answer(lines: list[dict[str, Any]], plain: dict[str, Any]) -> None:
    """The items (ordered by index) are the answer's data and errors; the last line the rest of it (a stream
    is native: /v1/embeddings' OpenAI ``object`` and ``usage`` keys are not in it)."""
    plain = {**plain, "data": [{k: v for k, v in d.items() if k != "object"} for d in plain["data"]]}
    *items, last = lines
    assert {line["event"] for line in items} == {"item"} and last["event"] == "done"
    results = sorted((i for i in items if "error" not in i), key=lambda i: i["index"])
    assert [{k: v for k, v in i.items() if k != "event"} for i in results] == plain["data"]
    errors = sorted(({"index": i["index"], "image": i["image"], **i["error"]} for i in items if "error" in i),
                    key=lambda e: e["index"])
    assert errors == plain["errors"] == last["errors"]
    assert "data" not in last and last["model"] == plain["model"]
    assert set(last["timings_ms"]) == set(plain["timings_ms"]) and last["request_id"]
