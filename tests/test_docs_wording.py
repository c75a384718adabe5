"""README.md and docs/ describe the software as it is.

No internal tracker numbers, no account of which machine was available or lent, no change history, and papers
named by their authors, never by an internal file number. These are words a user cannot decode."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FORBIDDEN = {
    "an internal issue number": r"\bissues?\s+#?\d+",
    "the issue's target or reference": r"\bthe issue's\b",
    "a work session": r"\bsessions?\b",
    "a machine lent or not": r"\blent\b|\bno GPU was (?:available|lent)\b",
    "change history": r"\bthis change\b|\bthis version\b|\bprevious (?:version|default)\b|\buntil this version\b",
    "an internal stop label": r"\bstop \d",
    "a paper by its internal file number": r"\bseeds? 00\d\b|\bdigest 00\d\b",
}
PATTERN = re.compile("|".join(f"(?P<k{i}>{p})" for i, p in enumerate(FORBIDDEN.values())), re.IGNORECASE)
KINDS = list(FORBIDDEN)


def _hits(text: str) -> list[tuple[int, str, str]]:
    out = []
    for m in PATTERN.finditer(text):
        kind = KINDS[int(next(k for k, v in m.groupdict().items() if v is not None)[1:])]
        out.append((text.count("\n", 0, m.start()) + 1, kind, m.group(0)))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_page_describes_the_software_as_it_is(page):
    hits = _hits(page.read_text(encoding="utf-8"))
    assert not hits, "\n".join(f"{page.relative_to(ROOT)}:{line}: {kind}: {word!r}" for line, kind, word in hits)


@pytest.mark.parametrize("text", [
    "measured for issue 15", "(issue #7)", "the issue's limit", "no GPU was lent to this session",
    "a GPU lent for 15 minutes", "an earlier run of this change", "until this version", "the previous default",
    "seed 003's batch size", "digest 000 §7", "Session notes", "stop 3",
])
def test_the_patterns_catch_project_jargon(text):
    assert _hits(text), text


@pytest.mark.parametrize("text", [
    "a silent failure", "excellent accuracy", "the lenticular", "the sessionless API", "--seed 0",
    "seeds 0, 1, 2", "an issue thread behind each cell", "errors that stop the run", "lenient parsing",
    "Panda et al., linear scaling", "the random seed 1003",
])
def test_the_patterns_spare_ordinary_words(text):
    assert not _hits(text), _hits(text)
