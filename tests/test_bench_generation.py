"""bench/generation.py --quick: the bench runs end to end on a tiny random LLaMA and writes its JSON (a smoke
test; it measures nothing)."""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

import pytest
from conftest import script_module

pytest.importorskip("transformers")
pytest.importorskip("sacrebleu")
if importlib.util.find_spec("chitchat_dataset") is None:
    pytest.skip("needs chitchat-dataset", allow_module_level=True)

BENCH = Path(__file__).resolve().parents[1] / "bench" / "generation.py"


@pytest.fixture
def bench():
    with script_module(BENCH, "bench_generation") as module:
        yield module


def test_quick_bench_writes_every_cell(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("PRIVTUNE_HOME", str(tmp_path / "home"))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the bench makes its work folder
    results = bench.main(["--quick", "--cells", "zero-shot,public-only,tune-default,nonprivate-lora,nonprivate-lora-public",
                          "--out",
                          str(tmp_path)])
    left = sorted(p.name for p in scratch.glob("privtune-bench-generation-*"))  # (torch may cache its own there)
    assert not left, f"the bench left its work folder (split copies, models) behind: {left}"
    cells = results["cells"]
    assert set(cells) == {"zero-shot", "public-only", "tune-default@eps=8", "nonprivate-lora", "nonprivate-lora-public"}
    # the public-only cell is the tuned cell's warm start: half of the 24 public pairs, no private pair
    assert cells["public-only"]["public_pairs"] == 12 and cells["public-only"]["epsilon"] == 0.0
    assert cells["tune-default@eps=8"]["epsilon"] <= 8 * (1 + 1e-6) and cells["zero-shot"]["epsilon"] == 0.0
    assert cells["nonprivate-lora"]["label"] == "NOT PRIVATE"
    # the fair reference of a warm-started cell: the private pairs and the same 12 warm-start pairs
    assert cells["nonprivate-lora-public"]["label"] == "NOT PRIVATE" and cells["nonprivate-lora-public"]["public_pairs"] == 12
    for cell in cells.values():
        assert {"bleu", "rouge_l", "perplexity", "seconds"} <= set(cell) and cell["scored_rows"] == 8
        assert cell["bleu_bootstrap_sd"] >= 0.0
    written = list(tmp_path.glob("generation-quick-*.json"))
    assert len(written) == 1 and json.loads(written[0].read_text())["cells"].keys() == cells.keys()


def test_bleu_bootstrap_sd_is_zero_for_a_constant_score_and_grows_with_mixed_rows(bench):
    refs = [f"the cat sat on mat number {i} today" for i in range(80)]
    assert bench.bleu_bootstrap_sd(refs, refs, resamples=50) < 1e-9  # every resample scores 100
    half = [r if i % 2 else "nothing alike here at all" for i, r in enumerate(refs)]
    sd80 = bench.bleu_bootstrap_sd(half, refs, resamples=300)
    sd20 = bench.bleu_bootstrap_sd(half[:20], refs[:20], resamples=300)
    # a resampling spread: it shrinks like 1/√n, so a quarter of the rows gives about twice the deviation
    assert sd80 > 0 and 1.5 < sd20 / sd80 < 2.7
    assert sd80 == bench.bleu_bootstrap_sd(half, refs, resamples=300)  # seeded: the bench's number is repeatable
