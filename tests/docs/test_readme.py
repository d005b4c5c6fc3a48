"""The README is the front door: its settings table must list every setting exactly as the code has it, its
Python client example must work against a real server, its layout must name files that exist, and every
relative link in it and in the documents it leads to (docs/, deploy/) must reach a file and a heading."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import requests

from harness.imagehost import ImageHost
from harness.launch import ROOT, GunicornServer
from service.settings import settings_table

BLOCK = re.compile(r"<!-- settings-table:.*?-->\n(.*?)<!-- /settings-table -->", re.S)
PYTHON_CLIENT = re.compile(r"### From Python.*?```python\n(.*?)```", re.S)
LAYOUT = re.compile(r"^## Layout\n.*?```\n(.*?)```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")  # a Markdown link's target
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
DOCS = [ROOT / "README.md", *sorted(ROOT.glob("docs/**/*.md")), *sorted(ROOT.glob("deploy/**/*.md"))]


def anchors(markdown: str) -> set[str]:
    """The ids GitHub gives a document's headings: lower case, punctuation dropped, spaces to hyphens."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.*)$", FENCE.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)  # a repeated heading gets -1, -2, ...
        seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(doc: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{target} (no such heading)")
    return broken


def test_readme_settings_table_matches_the_code() -> None:
    readme = (ROOT / "README.md").read_text()
    match = BLOCK.search(readme)
    assert match, "settings-table markers missing from README.md"
    assert match.group(1).strip() == settings_table().strip(), "run `make readme` to regenerate the table"


def test_readme_names_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make serve" in readme and "make test" in readme


@pytest.mark.e2e  # a real server: not in make test-fast
def test_readme_python_client_embeds_and_raises_on_a_bad_image(server: GunicornServer,
                                                                image_host: ImageHost) -> None:
    match = PYTHON_CLIENT.search((ROOT / "README.md").read_text())
    assert match, "the README's Python client example is missing"
    client: dict[str, Any] = {}
    exec(match.group(1), client)  # the example as a user would paste it
    url = server.url + "/v1/embeddings"
    try:
        rows = client["embed"]([image_host.url("img001.jpg"), image_host.url("img002.jpg")], url=url)
        assert len(rows) == 2 and len(rows[0]) == 512 and rows[0] != rows[1]  # resnet18 embeddings
        with pytest.raises(requests.HTTPError) as raised:
            client["embed"]([image_host.url("truncated.jpg")], url=url)
        assert raised.value.response.status_code == 422
        assert raised.value.response.json()["error"]["code"] == "truncated_image"
    finally:
        client["session"].close()  # the example's process-wide session: closed here, not by a late GC


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_a_file_and_a_heading(doc: Path) -> None:
    assert broken_links(doc) == []


def test_readme_layout_names_files_that_exist() -> None:
    match = LAYOUT.search((ROOT / "README.md").read_text())
    assert match, "the README's Layout section (a code block) is missing"
    named = set(re.findall(r"[\w@]+(?:\.[\w@]+)*\.(?:py|md)\b", match.group(1)))  # gunicorn.conf.py too
    assert {"routes.py", "dataplane.py", "rules.py", "batcher.py", "runner.py", "model.py"} <= named
    code = [*ROOT.glob("*.py"), *(p for d in ("service", "harness", "bench", "tests") for p in (ROOT / d).rglob("*.py"))]
    present = {p.name for p in code} | {p.name for p in DOCS}
    assert sorted(named - present) == [], "the README's layout names files that are gone"
