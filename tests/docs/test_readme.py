"""The README is the front door: its settings tables (and docs/SIZING.md's Tuning table) must list every setting
exactly as the code has it, its Python client example must work against a real server, its layout must name every
module of service/ and only files that exist, and every relative link in it and in the documents it leads to
(docs/, deploy/) must reach a file and a heading."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import requests

from harness.imagehost import ImageHost
from harness.launch import ROOT, GunicornServer
from service.settings_docs import settings_table, tuning_table

BLOCK = re.compile(r"<!-- settings-table:.*?-->\n(.*?)<!-- /settings-table -->", re.S)
TUNING_BLOCK = re.compile(r"^## Tuning\n.*?<!-- tuning-table:.*?-->\n(.*?)<!-- /tuning-table -->", re.S | re.M)
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


def test_sizing_guide_tuning_table_matches_the_code() -> None:
    match = TUNING_BLOCK.search((ROOT / "docs" / "SIZING.md").read_text())
    assert match, "docs/SIZING.md has no Tuning section with tuning-table markers"
    assert match.group(1).strip() == tuning_table().strip(), "run `make readme` to regenerate the table"


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


SERVICE = ROOT / "service"
NAMED = re.compile(r"(?<![\w@./-])((?:[\w-]+/)*[\w@]+(?:\.[\w@]+)*\.(?:py|md))\b")  # gunicorn.conf.py, service/app.py
SECTION = re.compile(r"^service/((?:\w+/)*).*(?:\n[ \t]+.*)*", re.M)  # a service/ row and the indented rows under it


def layout() -> str:
    match = LAYOUT.search((ROOT / "README.md").read_text())
    assert match, "the README's Layout section (a code block) is missing"
    return match.group(1)


def layout_sections(block: str) -> dict[Path, str]:
    """The Layout's rows about each part of service/: a row that starts ``service/<part>/`` and the indented
    rows under it; the rows of top-level modules (``service/app.py``) are about service/ itself."""
    sections: dict[Path, str] = {}
    for match in SECTION.finditer(block):
        part = SERVICE / match.group(1)
        sections[part] = sections.get(part, "") + match.group(0) + "\n"
    return sections


def test_readme_layout_names_every_service_module_where_it_lives() -> None:
    """Every module under service/ but ``__init__.py`` is named in its part's rows, a nested package's with
    the package (``scheduling/``): a module added without a line in the Layout fails here."""
    sections = layout_sections(layout())
    missing = []
    for path in sorted(SERVICE.rglob("*.py")):
        rel = path.relative_to(SERVICE)
        if path.name == "__init__.py":
            continue
        text = sections.get(SERVICE / rel.parts[0] if len(rel.parts) > 1 else SERVICE, "")
        wanted = [*(f"{package}/" for package in rel.parts[1:-1]), path.name]
        if any(re.search(rf"(?<![\w@.]){re.escape(name)}", text) is None for name in wanted):
            missing.append(str(rel))
    assert missing == [], "the README's Layout leaves these service/ modules out"


def test_readme_layout_names_files_that_exist() -> None:
    """A file named in a part's rows is in that part (a path is from the root); any other anywhere."""
    block = layout()
    gone = []
    for part, text in layout_sections(block).items():
        for name in NAMED.findall(text):
            if "/" in name:
                found = (ROOT / name).exists()
            else:
                found = (part / name).exists() if part == SERVICE else any(part.rglob(name))
            if not found:
                gone.append(f"{name} (in {part.relative_to(ROOT)})")
    code = [*ROOT.glob("*.py"), *(p for d in ("service", "harness", "bench", "tests") for p in (ROOT / d).rglob("*.py"))]
    present = {p.name for p in code} | {p.name for p in DOCS}
    for name in NAMED.findall(SECTION.sub("", block)):
        if not ((ROOT / name).exists() if "/" in name else Path(name).name in present):
            gone.append(name)
    assert sorted(gone) == [], "the README's Layout names files that are gone"
