"""The README is the front door: its settings table must list every setting exactly as the code has it."""

from __future__ import annotations

import re

from bench.launch import ROOT
from service.settings import settings_table

BLOCK = re.compile(r"<!-- settings-table:.*?-->\n(.*?)<!-- /settings-table -->", re.S)


def test_readme_settings_table_matches_the_code() -> None:
    readme = (ROOT / "README.md").read_text()
    match = BLOCK.search(readme)
    assert match, "settings-table markers missing from README.md"
    assert match.group(1).strip() == settings_table().strip(), "run `make readme` to regenerate the table"


def test_readme_names_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make serve" in readme and "make test" in readme
