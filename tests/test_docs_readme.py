"""The README is a short user's guide whose install and test commands are the ones CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
CI = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
MAX_LINES = 200


def _readme_commands() -> list[str]:
    """Every command line of the README's bash blocks, without its trailing comment."""
    blocks = re.findall(r"^```bash\n(.*?)^```", README, re.S | re.M)
    return [line.split("  #")[0].strip() for block in blocks for line in block.splitlines() if line.strip()]


def _ci_commands() -> list[str]:
    """The pip and python commands .ci/run executes (not its comments)."""
    lines = [line.strip() for line in CI.splitlines()]
    return [line for line in lines if re.match(r"^(pip|python) ", line)]


def test_readme_is_short():
    n = len(README.splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; keep it a user's guide of at most {MAX_LINES}, details in docs/"


def test_ci_runs_the_readme_commands():
    ci = _ci_commands()
    assert 'pip install -e ".[dev]"' in ci and "python -m pytest -q" in ci, ci
    readme = _readme_commands()
    missing = [c for c in ci if c not in readme]
    assert not missing, f".ci/run runs commands the README does not show: {missing}"


def test_readme_names_the_system_packages_ci_installs():
    packages = set(re.findall(r"apt_install ([a-z][a-z0-9-]*)", CI))
    assert packages == {"postgresql", "dataset-fashion-mnist", "chromium"}, packages
    install = next(c for c in _readme_commands() if "apt-get install" in c)
    assert all(p in install.split() for p in packages), install


def test_readme_runs_the_main_job():
    assert "privtune tune" in _readme_commands()


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_relative_links_and_anchors_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path) if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", file.read_text(encoding="utf-8"), re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_docs_page_can_be_reached_from_the_readme():
    """A page nobody links to is a page nobody reads: follow links from README.md through docs/."""
    docs = ROOT / "docs"
    seen, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in seen or not page.is_file():
            continue
        seen.add(page)
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)", page.read_text(encoding="utf-8")):
            if target.endswith(".md") and not target.startswith(("http://", "https://")):
                todo.append((page.parent / target).resolve())
    unreached = [p.relative_to(ROOT).as_posix() for p in sorted(docs.rglob("*.md")) if p.resolve() not in seen]
    assert not unreached, f"pages no link reaches from README.md: {unreached}"
