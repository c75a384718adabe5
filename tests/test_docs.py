"""Run the Python examples of the documentation (docs/*.md).

Every fenced block opened with ```python is run, each in a fresh interpreter (a fresh
namespace, so every block must be self-contained), in a temporary working directory,
offline, with a private ledger and a timeout.  The working directory holds small
``train.tsv``, ``dev.tsv`` and ``train.jsonl`` files (rows of the embedded SST-2 subset), the
names the examples use for "your data".  A block whose first line is
``# doctest: skip`` is not run (for examples that need a long training run or files
the reader has but the test suite has not).  Blocks tagged anything else (```bash,
```yaml, ```text) are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
TIMEOUT_S = 120
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def _blocks() -> list:
    params = []
    for md in sorted(DOCS.rglob("*.md")) if DOCS.is_dir() else []:
        text = md.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            code = m.group(1)
            line = text.count("\n", 0, m.start()) + 1
            first = code.lstrip().splitlines()[0].strip() if code.strip() else ""
            marks = [pytest.mark.skip(reason="marked `# doctest: skip` in the docs")] if (
                first.replace(" ", "").lower() == "#doctest:skip") else []
            name = md.relative_to(DOCS).as_posix()
            params.append(pytest.param(md, line, code, id=f"{name}:{line}", marks=marks))
    return params


def test_docs_exist():
    for page in ("index.md", "quickstart.md", "privacy-model.md", "cli.md", "api.md"):
        assert (DOCS / page).is_file(), page


PLACEHOLDER = re.compile(r"@@[A-Z_]+@@")


def test_no_unfilled_placeholders():
    """README and docs quote measured numbers; a `@@NAME@@` left behind means a number was never filled in."""
    pages = [DOCS.parent / "README.md", *sorted(DOCS.rglob("*.md"))]
    left = [f"{p.name}: {m.group(0)}" for p in pages for m in PLACEHOLDER.finditer(p.read_text(encoding="utf-8"))]
    assert not left, f"unfilled placeholders: {left}"


def test_fence_parser():
    text = "x\n```python\na = 1\n```\n```bash\nls\n```\n```python\n# doctest: skip\nb\n```\n"
    found = [m.group(1) for m in FENCE.finditer(text)]
    assert found == ["a = 1\n", "# doctest: skip\nb\n"]


def _write_example_data(folder: Path, rows: int = 40) -> None:
    """The reader's "train.tsv" / "dev.tsv" / "train.jsonl": small slices of the embedded SST-2 subset."""
    import json

    from privtune.data.datasets import embedded_path

    for name, split in (("train", "train"), ("dev", "test")):
        lines = embedded_path(split).read_text(encoding="utf-8").splitlines()[1 : rows + 1]
        pairs = [(line.split("\t")[1], int(line.split("\t")[0])) for line in lines]
        with open(folder / f"{name}.tsv", "w", encoding="utf-8") as f:
            f.write("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in pairs))
        if name == "train":
            with open(folder / "train.jsonl", "w", encoding="utf-8") as f:
                f.writelines(json.dumps({"text": t, "label": y}) + "\n" for t, y in pairs)


@pytest.mark.parametrize("md, line, code", _blocks())
def test_doc_example_runs(md, line, code, tmp_path):
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MPLBACKEND": "Agg", "TOKENIZERS_PARALLELISM": "false",
        "PRIVTUNE_LEDGER": f"sqlite:///{tmp_path / 'ledger.db'}", "PRIVTUNE_HOME": str(tmp_path / "home"),
        "OMP_NUM_THREADS": "1",
    })
    _write_example_data(tmp_path)
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    try:
        res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{md.name}:{line}: the example ran longer than {TIMEOUT_S} s; make it smaller or start it "
                    "with `# doctest: skip`")
    if res.returncode != 0:
        pytest.fail(f"{md.name}:{line}: the example failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
