"""The stream bench's table: each round's streamed / plain is the median of its pairs' ratios, and the "all"
row pools every round's pairs (a bound of 2% needs more than one round's 6 albums)."""

from __future__ import annotations

from typing import Any

from bench.report import rows_table
from bench.stream_bench import _pooled, _table

SERVER, CAPPED = "greenserve (x)", "capped at 60 (x)"


def _round(n: int, ratios: list[float], firsts: list[float], alone: float) -> dict[str, Any]:
    shared = {"p99_ms": 300.0, "statuses": {"200": 10}, "backfill": {"200": 4}}
    return {"round": n,
            SERVER: {"alone_ms": alone, "stream_first_ms": firsts, "ratios": ratios,
                     "stream_forwards": [2] * len(ratios), "plain_forwards": [1] * len(ratios),
                     "idle": {"p99_ms": 150.0}, "shared": shared},
            CAPPED: {"shared": {**shared, "backfill": {"429 over_share": 3}}}}


def test_rounds_show_their_pairs_median_and_all_pools_every_pair() -> None:
    rounds = [_round(1, [0.90, 1.00, 1.30], [150.0, 160.0, 170.0], 140.0),
              _round(2, [1.01, 1.02, 1.50], [150.0, 200.0, 210.0], 160.0)]

    rows = _table(rounds, [SERVER, CAPPED]) + _pooled(rounds, [SERVER, CAPPED])

    first, capped, _, _, pooled = rows
    assert first["streamed / plain total"] == "1.000 (3 pairs)"
    assert first["first line - alone (ms)"] == "20"
    assert first["forwards streamed / plain"] == "2.0 / 1.0"
    assert first["shared / idle p99"] == "2.00"
    assert capped["streamed / plain total"] == "-" and capped["search p99 idle (ms)"] == "-"
    assert (pooled["round"], pooled["server"]) == ("all", SERVER)
    assert pooled["streamed / plain total"] == "1.015 (6 pairs)"  # median of all six, not of the rounds'
    assert pooled["first line - alone (ms)"] == "15"  # 165 (the median of all firsts) - 150 (of the rounds' alones)
    table = rows_table(rows)
    assert table.splitlines()[-1].startswith("| all | greenserve (x) | 15 | 1.015 (6 pairs) | 2.0 / 1.0 |  |")


def test_a_server_that_does_not_stream_gets_no_pooled_row() -> None:
    plain = _round(1, [], [], 140.0)
    assert _pooled([plain], [SERVER, CAPPED]) == []
