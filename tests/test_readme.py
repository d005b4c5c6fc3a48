"""The README is the front door: its settings table must list every setting exactly as the code has it,
and its Python client example must work against a real server."""

from __future__ import annotations

import re
from typing import Any

import pytest
import requests

from harness.imagehost import ImageHost
from harness.launch import ROOT, GunicornServer
from service.settings import settings_table

BLOCK = re.compile(r"<!-- settings-table:.*?-->\n(.*?)<!-- /settings-table -->", re.S)
PYTHON_CLIENT = re.compile(r"### From Python.*?```python\n(.*?)```", re.S)


def test_readme_settings_table_matches_the_code() -> None:
    readme = (ROOT / "README.md").read_text()
    match = BLOCK.search(readme)
    assert match, "settings-table markers missing from README.md"
    assert match.group(1).strip() == settings_table().strip(), "run `make readme` to regenerate the table"


def test_readme_names_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make serve" in readme and "make test" in readme


def test_readme_python_client_embeds_and_raises_on_a_bad_image(server: GunicornServer,
                                                                image_host: ImageHost) -> None:
    match = PYTHON_CLIENT.search((ROOT / "README.md").read_text())
    assert match, "the README's Python client example is missing"
    client: dict[str, Any] = {}
    exec(match.group(1), client)  # the example as a user would paste it
    url = server.url + "/v1/embeddings"
    rows = client["embed"]([image_host.url("img001.jpg"), image_host.url("img002.jpg")], url=url)
    assert len(rows) == 2 and len(rows[0]) == 512 and rows[0] != rows[1]  # resnet18 embeddings
    with pytest.raises(requests.HTTPError) as raised:
        client["embed"]([image_host.url("truncated.jpg")], url=url)
    assert raised.value.response.status_code == 422
    assert raised.value.response.json()["error"]["code"] == "truncated_image"
