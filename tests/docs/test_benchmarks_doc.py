"""docs/BENCHMARKS.md holds the current figures only: at most 400 lines, one table per topic, each topic naming the
command that reproduces it, the machine it ran on and its raw output, and no heading named after a measuring run
(the run-by-run story lives in docs/history/)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "BENCHMARKS.md"
MAX_LINES = 400
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
HEADING = re.compile(r"^(#{1,6}) (.+)$", re.M)
TOPIC = re.compile(r"^(#{2,3}) (.+)$", re.M)  # a topic section: deeper headings stay inside it
TABLE = re.compile(r"^\|(?:\s*:?-{3,}:?\s*\|)+\s*$", re.M)  # a table's second line: one per table
NOT_A_TOPIC = {"History"}  # a link to docs/history/README.md, not a measurement
LABELS = ("Reproduce:", "Machine:", "Raw:")
# what a heading written per measuring run names: a commit (hash or word), a run or pass, an issue, a date
RUN_NAMES = {
    "commit hash": re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),
    "commit": re.compile(r"\bcommits?\b", re.I),
    "run number": re.compile(r"\b(?:runs?|rounds?|pass(?:es)?|sessions?|probes?|waves?)\s*#?\d+\b|"
                             r"\b(?:first|second|third|fourth|fifth|earlier|later|previous|next|latest|last|another)"
                             r"\s+(?:full\s+)?(?:run|pass|session|probe|wave)\b", re.I),
    "issue number": re.compile(r"\b(?:issue|pr|pull request)\s*#?\d+|#\d+", re.I),
    "date": re.compile(r"\b\d{4}-\d{2}(?:-\d{2})?\b|\b(?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.?"
                       r"\s+\d{1,2}\b|\b\d{1,2}\s+(?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\b", re.I),
}


def headings(markdown: str) -> list[str]:
    return [title.strip() for _, title in HEADING.findall(FENCE.sub("", markdown))]


def sections(markdown: str) -> dict[str, str]:
    """Each ``##``/``###`` section's text up to the next such heading, by its title (code blocks blanked)."""
    parts = TOPIC.split(FENCE.sub("", markdown))  # [before, hashes, title, text, hashes, title, text, ...]
    return {parts[i + 1].strip(): parts[i + 2] for i in range(1, len(parts), 3)}


def run_names(heading: str) -> list[str]:
    return [what for what, pattern in RUN_NAMES.items() if pattern.search(heading)]


def tables_per_section(markdown: str) -> dict[str, int]:
    return {title: len(TABLE.findall(text)) for title, text in sections(markdown).items()}


def missing_labels(markdown: str) -> dict[str, list[str]]:
    found = {title: [label for label in LABELS if label not in text] for title, text in sections(markdown).items()
             if title not in NOT_A_TOPIC}
    return {title: labels for title, labels in found.items() if labels}


def test_benchmarks_is_at_most_400_lines() -> None:
    assert len(DOC.read_text().splitlines()) <= MAX_LINES, "move runs and before/after pairs to docs/history/"


def test_no_heading_names_a_commit_a_run_an_issue_or_a_date() -> None:
    named = {h: run_names(h) for h in headings(DOC.read_text()) if run_names(h)}
    assert named == {}, "a heading per measuring run: give the topic, and the run in the Machine: line"


def test_each_topic_section_holds_exactly_one_table() -> None:
    counts = tables_per_section(DOC.read_text())
    assert counts and {title: n for title, n in counts.items() if n != 1 and title not in NOT_A_TOPIC} == {}


def test_each_topic_names_its_command_machine_and_raw_output() -> None:
    assert missing_labels(DOC.read_text()) == {}


# ---------------------------------------------------------------------- the rules catch what they are for

def test_headings_written_per_run_are_caught() -> None:
    caught = ["Full run (resnet50, commit 67cb706), closed", "Again with the first decode's read hold (add7587)",
              "Urgent forwards (issue 26, a third session)", "Engine, fifth pass", "Run 2", "Embedding cache (#27)",
              "Hostile bodies, 2026-12-02", "A later session", "Previous full run"]
    kept = ["Saturation in the steady state", "gevent vs asyncio on CLIP ViT-B/32", "Workers for a ViT on 2 cores",
            "Memory per worker", "The standard protocols", "GPU", "A batch size not run before"]
    assert [h for h in caught if not run_names(h)] == []
    assert {h: run_names(h) for h in kept if run_names(h)} == {}


def test_tables_are_counted_per_topic_section_and_code_blocks_are_not_tables() -> None:
    doc = ("# T\n\n| a |\n|---|\n\n## One\n\n| a | b |\n|---|:---:|\n| 1 | 2 |\n\n## Two\n\n| a |\n|---|\n\n| b |\n"
           "|---|\n\n### None\n\n```\n| a |\n|---|\n```\n\n#### Deeper\n\n| c |\n|---|\n")
    assert tables_per_section(doc) == {"One": 1, "Two": 2, "None": 1}  # the #### table is None's


def test_a_topic_without_its_command_machine_or_raw_output_is_named() -> None:
    doc = ("## Cache\n\n| a |\n|---|\n\nReproduce: `x`. Machine: 2 cores. Raw: none kept.\n\n## Fetch\n\n| a |\n"
           "|---|\n\nReproduce: `y`.\n\n## History\n\n| file |\n|---|\n")
    assert missing_labels(doc) == {"Fetch": ["Machine:", "Raw:"]}
