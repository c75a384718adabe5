"""bench/generation.py --quick: the bench runs end to end on a tiny random LLaMA and writes its JSON (a smoke
test; it measures nothing)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("sacrebleu")
if importlib.util.find_spec("chitchat_dataset") is None:
    pytest.skip("needs chitchat-dataset", allow_module_level=True)

BENCH = Path(__file__).resolve().parents[1] / "bench" / "generation.py"


def test_quick_bench_writes_every_cell(tmp_path, monkeypatch):
    monkeypatch.setenv("PRIVTUNE_HOME", str(tmp_path / "home"))
    spec = importlib.util.spec_from_file_location("bench_generation", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = bench.main(["--quick", "--cells", "zero-shot,tune-default,nonprivate-lora", "--out", str(tmp_path)])
    cells = results["cells"]
    assert set(cells) == {"zero-shot", "tune-default@eps=8", "nonprivate-lora"}
    assert cells["tune-default@eps=8"]["epsilon"] <= 8 * (1 + 1e-6) and cells["zero-shot"]["epsilon"] == 0.0
    assert cells["nonprivate-lora"]["label"] == "NOT PRIVATE"
    for cell in cells.values():
        assert {"bleu", "rouge_l", "perplexity", "seconds"} <= set(cell) and cell["scored_rows"] == 8
    written = list(tmp_path.glob("generation-quick-*.json"))
    assert len(written) == 1 and json.loads(written[0].read_text())["cells"].keys() == cells.keys()
