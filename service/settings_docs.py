"""The settings as Markdown, made from ``Settings``' fields: the README's tables, one per section
(``greenserve settings --markdown``, ``make readme``), and docs/SIZING.md's table of the Tuning switches."""

from __future__ import annotations

import dataclasses
from typing import Any

from service.settings import SECTIONS, TUNING, Settings, env_name

__all__ = ["fields_in", "settings_table", "tuning_table"]


def fields_in(section: str) -> list[dataclasses.Field[Any]]:
    """The settings of ``section``, in the order they are declared."""
    return [f for f in dataclasses.fields(Settings) if f.metadata["section"] == section]


def settings_table() -> str:
    """The README's settings: a table per section, in ``SECTIONS``' order; the Tuning switches by name, with
    a link to their table in docs/SIZING.md (``tuning_table``)."""
    parts = []
    for section in SECTIONS:
        if section != TUNING:
            parts += [f"### {section}", "", _table(fields_in(section)), ""]
    names = ", ".join(f"`{env_name(f.name)}`" for f in fields_in(TUNING))
    parts += [f"### {TUNING}", "", "Switches that turn a mechanism off to measure what it buys; a deployment leaves "
              f"them at their defaults. What each turns off, and what for: [docs/SIZING.md](docs/SIZING.md#tuning). "
              f"{names}."]
    return "\n".join(parts)


def tuning_table() -> str:
    """docs/SIZING.md's table of the Tuning switches."""
    return _table(fields_in(TUNING), unit=False)


def _table(fields: list[dataclasses.Field[Any]], *, unit: bool = True) -> str:
    rows = ["| variable | default | unit | what |", "|---|---|---|---|"] if unit else [
        "| variable | default | what it does, what turning it off leaves, and what for |", "|---|---|---|"]
    for f in fields:
        doc = f.metadata["doc"].replace("|", "\\|")
        cells = [f"`{env_name(f.name)}`", _default_text(f), *([f.metadata["unit"]] if unit else []), doc]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _default_text(f: dataclasses.Field[Any]) -> str:
    if f.name == "workers":
        return "number of cores"
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if isinstance(default, bool):
        default = str(default).lower()
    elif isinstance(default, tuple):
        default = ",".join(default)
    return f"`{default}`" if default != "" else "(empty)"
