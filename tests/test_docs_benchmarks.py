"""docs/benchmarks.md and the README's results table are what the kept result files give.

Both are written by ``scripts/make_benchmarks.py`` from ``bench/results/``; these tests regenerate them in memory
and compare, so a changed or added result file without a regenerated page fails here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import script_module

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "make_benchmarks.py"


@pytest.fixture(scope="module")
def make_benchmarks():
    with script_module(SCRIPT, "make_benchmarks") as module:
        yield module


def test_benchmarks_page_is_current(make_benchmarks):
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert page == make_benchmarks.render_page(), "docs/benchmarks.md is stale: run python scripts/make_benchmarks.py"


def test_readme_results_table_is_current(make_benchmarks):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = make_benchmarks.render_readme_table()
    assert table, "the README's results table would be empty: no kept SST-2 cell of its columns"
    assert make_benchmarks.update_readme(readme, table) == readme, \
        "README.md's results table is stale: run python scripts/make_benchmarks.py"


def test_check_mode_passes_on_the_committed_files(make_benchmarks, capsys):
    assert make_benchmarks.main(["--check"]) == 0, capsys.readouterr().err


def test_a_section_without_files_is_left_out(make_benchmarks, tmp_path):
    page = make_benchmarks.render_page(tmp_path)
    assert page.startswith("# Benchmarks")
    assert "## SST-2" not in page
    assert make_benchmarks.render_readme_table(tmp_path) == ""


def test_the_page_follows_a_changed_result_file(make_benchmarks, tmp_path):
    """The numbers come from the files: changing a kept cell's dev accuracy changes the page and the table."""
    shutil.copytree(ROOT / "bench" / "results" / "sst2_full", tmp_path / "sst2_full")
    cell = tmp_path / "sst2_full" / "full" / "default_eps1_seed0.json"
    before_page, before_table = make_benchmarks.render_page(tmp_path), make_benchmarks.render_readme_table(tmp_path)
    kept = json.loads(cell.read_text(encoding="utf-8"))
    kept["dev_accuracy"] = 0.5123
    cell.write_text(json.dumps(kept), encoding="utf-8")
    after_page, after_table = make_benchmarks.render_page(tmp_path), make_benchmarks.render_readme_table(tmp_path)
    assert after_page != before_page and after_table != before_table
    assert "51.2 % (seed 0" in after_table


def test_seeds_of_one_cell_are_averaged(make_benchmarks, tmp_path):
    folder = tmp_path / "sst2_full" / "full"
    folder.mkdir(parents=True)
    source = json.loads((ROOT / "bench/results/sst2_full/full/default_eps1_seed0.json").read_text(encoding="utf-8"))
    for seed, acc in ((0, 0.84), (1, 0.86)):
        (folder / f"default_eps1_seed{seed}.json").write_text(json.dumps(source | {"dev_accuracy": acc}))
    assert "85.0 ± 1.4 % (seeds 0, 1" in make_benchmarks.render_readme_table(tmp_path)


def test_a_registered_section_is_rendered_from_its_files(make_benchmarks, tmp_path, monkeypatch):
    """Adding a benchmark is one renderer and one registry entry."""
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "speed.json").write_text(json.dumps({"examples_per_second": 12.5}))

    def render(files):
        return "## Engine\n\n" + "".join(f"{json.loads(p.read_text())['examples_per_second']} ex/s\n" for p in files)

    section = make_benchmarks.Section("engine", ("engine/*.json",), render)
    monkeypatch.setattr(make_benchmarks, "SECTIONS", [*make_benchmarks.SECTIONS, section])
    page = make_benchmarks.render_page(tmp_path)
    assert "## Engine\n\n12.5 ex/s" in page


def test_the_generation_section_reads_the_bench_files_and_skips_smoke_tests(make_benchmarks, tmp_path):
    folder = tmp_path / "generation"
    folder.mkdir()
    cell = {"bleu": 1.234, "chrf": 15.5, "rouge_l": 7.25, "perplexity": 42.125, "scored_rows": 200, "epsilon": 0.0,
            "seconds": 600.0}
    run = {"config": {"private": 20000, "reported": 2000}, "cells": {"zero-shot": cell}, "started": "2026-01-01",
           "machine": {"cpus": 2, "torch_threads": 2, "load_before": 1.5, "model": "smollm2-135m", "max_length": 128}}
    (folder / "generation-20260101-000000.json").write_text(json.dumps(run))
    quick = {**run, "cells": {"zero-shot": {**cell, "bleu": 99.0}}, "started": "2026-01-02"}
    (folder / "generation-quick-20260102-000000.json").write_text(json.dumps(quick))
    page = make_benchmarks.render_page(tmp_path)
    assert "## Text generation" in page
    assert "| zero-shot model (no training) | – | – | 2,000 (200) | 1.23 | 15.50 | 7.25 | 42.12 | – | 10.0 min |" in page
    assert "99.00" not in page  # --quick smoke tests measure nothing and are not shown
    assert "| `privtune tune` (its default sweep, everything charged) | – |" in page  # not run: a dash
    assert "2 torch threads, 1-minute load 1.5" in page
    # a file with BLEU's bootstrap standard deviation shows it beside the score
    run["cells"]["zero-shot"]["bleu_bootstrap_sd"] = 0.2049
    (folder / "generation-20260101-000000.json").write_text(json.dumps(run))
    assert "| 2,000 (200) | 1.23 ± 0.20 | 15.50 |" in make_benchmarks.render_page(tmp_path)
    # runs on the same machine and model are one line, with the range of the loads they met
    tuned = {**run, "cells": {"tune-default": {**cell, "epsilon": 8.0}}, "started": "2026-01-03",
             "machine": {**run["machine"], "load_before": 0.25}}
    (folder / "generation-20260103-000000.json").write_text(json.dumps(tuned))
    page = make_benchmarks.render_page(tmp_path)
    assert page.count("Machine: ") == 1
    assert "Machine: 2 CPU cores, 2 torch threads, 1-minute load 0.25 to 1.5 before the 2 runs; model `smollm2-135m`" in page


def _generation_cell(bleu: float, perplexity: float = 9.0) -> dict:
    """One cell of a generation bench file (only BLEU and perplexity matter to the gain lines)."""
    return {"bleu": bleu, "chrf": 1.0, "rouge_l": 1.0, "perplexity": perplexity, "scored_rows": 10,
            "epsilon": 8.0, "seconds": 60.0}


def test_the_generation_section_states_the_share_of_the_non_private_gain(make_benchmarks, tmp_path):
    folder = tmp_path / "generation"
    folder.mkdir()

    run = {"config": {"private": 3000, "reported": 500}, "started": "2026-01-01",
           "cells": {"zero-shot": _generation_cell(1.0, 20.0), "tune-default@eps=8": _generation_cell(2.5, 15.0),
                     "nonprivate-lora": _generation_cell(3.0, 12.0), "nonprivate-full": _generation_cell(2.0, 10.0)}}
    (folder / "generation-20260101-000000.json").write_text(json.dumps(run))
    page = make_benchmarks.render_page(tmp_path)
    # (2.5 − 1) / (3 − 1): the best non-private run is the reference
    assert "At ε = 8 (3,000 private pairs, 500 reported (10 decoded)): `privtune tune` recovers **75 %**" in page
    assert "nonprivate-lora: +2.00 BLEU" in page
    # perplexity: (20 − 15) / (20 − 10), the reference the run with the lowest perplexity (full here)
    assert "In perplexity it recovers 50 % of the best non-private run's drop (nonprivate-full: 20.0 → 10.0" in page


def test_a_warm_started_row_is_held_against_non_private_lora_on_the_same_pairs(make_benchmarks, tmp_path):
    """The non-private run on the private pairs and the public warm-start pairs is a reference like the others: the
    best of them sets the gain, and the warm start's line no longer says the references saw private pairs only."""
    folder = tmp_path / "generation"
    folder.mkdir()
    warm = {**_generation_cell(2.5, 15.0), "hyperparameters": {"public_warm_start": {"pairs": 100}}}
    run = {"config": {"task": "bbc", "private": 1000, "public": 200, "reported": 300, "epochs": 2.0},
           "started": "2026-01-01",
           "cells": {"zero-shot": _generation_cell(1.0, 20.0), "public-only": _generation_cell(1.5, 18.0),
                     "tune-default@eps=8": warm, "nonprivate-lora": _generation_cell(2.0, 12.0),
                     "nonprivate-lora-public": {**_generation_cell(3.0, 11.0), "public_pairs": 100}}}
    cold = {"config": dict(run["config"], batch_size=128), "started": "2026-01-02",  # no warm start
            "cells": {"tune-default@eps=8": _generation_cell(1.5, 16.0)}}
    (folder / "generation-20260101-000000.json").write_text(json.dumps(run))
    (folder / "generation-20260102-000000.json").write_text(json.dumps(cold))
    page = make_benchmarks.render_page(tmp_path)
    # (2.5 − 1) / (3 − 1) against the run with the public pairs, not (2.5 − 1) / (2 − 1) = 150 %
    assert "public warm start on 100 pairs): `privtune tune` recovers **75 %**" in page
    assert "nonprivate-lora-public: +2.00 BLEU" in page
    assert "recovers 25 % (+0.50 BLEU)." in page and "private pairs only" not in page
    assert "warm-start pairs (NOT PRIVATE), 100 public pairs | – | 1,000 |" in page
    # a row that trained on the private pairs alone is held against the runs that did too: (1.5 − 1) / (2 − 1)
    assert "expected batch 128): `privtune tune` recovers **50 %**" in page and "(nonprivate-lora: +1.00 BLEU" in page


def test_a_generation_cell_the_bench_could_not_run_is_left_out(make_benchmarks, tmp_path):
    """A public split too small for a warm start gives the public cells a note and no scores: no row, no crash."""
    folder = tmp_path / "generation"
    folder.mkdir()
    note = {"note": "the public split is too small for a warm start"}
    run = {"config": {"private": 3000, "reported": 500}, "started": "2026-01-01",
           "cells": {"zero-shot": _generation_cell(1.0, 20.0), "tune-default@eps=8": _generation_cell(2.5, 15.0),
                     "nonprivate-lora": _generation_cell(3.0, 12.0), "public-only": note,
                     "nonprivate-lora-public": note}}
    (folder / "generation-20260101-000000.json").write_text(json.dumps(run))
    page = make_benchmarks.render_page(tmp_path)
    assert "| non-private LoRA, one epoch over the private pairs and the public warm-start pairs (NOT PRIVATE) | – |" in page
    assert "recovers **75 %**" in page


def test_the_gain_lines_merge_files_of_one_split_and_keep_other_splits_apart(make_benchmarks, tmp_path):
    folder = tmp_path / "generation"
    folder.mkdir()

    split = {"task": "bbc", "private": 1000, "public": 200, "reported": 300}
    old = {"config": split, "started": "2026-01-01",
           "cells": {"zero-shot": _generation_cell(1.0, 20.0), "tune-default@eps=8": _generation_cell(1.5, 15.0),
                     "nonprivate-lora": _generation_cell(3.0, 12.0)}}
    new = {"config": split, "started": "2026-01-02", "cells": {"tune-default@eps=8": _generation_cell(2.0, 14.0)}}
    other = {"config": dict(split, private=500), "started": "2026-01-03", "cells": {"tune-default@eps=8": _generation_cell(2.9)}}
    for i, run in enumerate((old, new, other)):
        (folder / f"generation-2026010{i + 1}-000000.json").write_text(json.dumps(run))
    page = make_benchmarks.render_page(tmp_path)
    # the newer file's private cell against the older file's references on the same split: (2 − 1) / (3 − 1)
    assert "recovers **50 %**" in page and "from 2 runs of the bench on the same split" in page
    assert "**75 %**" not in page and "**95 %**" not in page  # neither the replaced cell nor another split's


def test_rows_decoded_on_more_pairs_of_the_same_split_do_not_replace_the_others(make_benchmarks, tmp_path):
    """A newer file that decodes the whole reported split is another measurement, not a newer one of the same: the
    rows and the gain lines of the file that decoded 200 pairs stay beside it."""
    folder = tmp_path / "generation"
    folder.mkdir()
    split = {"private": 2000, "public": 1000, "reported": 1000}
    cells = {"zero-shot": _generation_cell(1.0, 20.0), "tune-default@eps=8": _generation_cell(1.5, 15.0),
             "nonprivate-lora": _generation_cell(2.0, 12.0)}
    few = {"config": dict(split, scored_rows=200), "started": "2026-01-01",
           "cells": {k: {**c, "scored_rows": 200} for k, c in cells.items()}}
    every = {"config": dict(split, scored_rows=1000), "started": "2026-01-02",
             "cells": {k: {**c, "bleu": 2 * c["bleu"], "scored_rows": 1000} for k, c in cells.items()}}
    for i, run in enumerate((few, every)):
        (folder / f"generation-2026010{i + 1}-000000.json").write_text(json.dumps(run))
    page = make_benchmarks.render_page(tmp_path)
    assert "| zero-shot model (no training) | – | – | 1,000 (200) | 1.00 |" in page
    assert "| zero-shot model (no training) | – | – | 1,000 (1,000) | 2.00 |" in page
    assert page.index("1,000 (200) | 1.00") < page.index("1,000 (1,000) | 2.00")
    assert "1,000 reported (200 decoded)): `privtune tune` recovers **50 %**" in page
    assert "1,000 reported (1,000 decoded)): `privtune tune` recovers **50 %**" in page


def test_tuned_cells_of_one_split_with_other_settings_keep_their_own_rows_and_lines(make_benchmarks, tmp_path):
    """Cells of one split that tuned with another --epochs or --batch-size are not replaced by the newer one: each
    is a row naming its setting, with its own gain line."""
    folder = tmp_path / "generation"
    folder.mkdir()
    split = {"task": "bbc", "private": 1000, "public": 200, "reported": 300}
    old = {"config": dict(split, epochs=2.0, batch_size=64), "started": "2026-01-01",
           "cells": {"zero-shot": _generation_cell(1.0, 20.0), "tune-default@eps=8": _generation_cell(2.0, 14.0),
                     "nonprivate-lora": _generation_cell(3.0, 12.0)}}
    new = {"config": dict(split, epochs=2.0, batch_size=128), "started": "2026-01-02",
           "cells": {"tune-default@eps=8": _generation_cell(1.5, 15.0)}}
    # the batch left to privtune: the one its run chose (64 here) replaces the older cell of that setting
    own = {"config": dict(split, epochs=2.0, batch_size=None), "started": "2026-01-03",
           "cells": {"tune-default@eps=8": {**_generation_cell(2.0, 14.0), "hyperparameters": {"batch_size": 64}}}}
    for i, run in enumerate((old, new, own)):
        (folder / f"generation-2026010{i + 1}-000000.json").write_text(json.dumps(run))
    page = make_benchmarks.render_page(tmp_path)
    assert page.count("2 epochs per trial, expected batch 64 | 8 |") == 1
    assert "everything charged), 2 epochs per trial, expected batch 64 | 8 | 1,000 | 300 (10) | 2.00 |" in page
    assert "everything charged), 2 epochs per trial, expected batch 128 | 8 | 1,000 | 300 (10) | 1.50 |" in page
    assert "(bbc, 1,000 private pairs, 300 reported (10 decoded), 2 epochs per trial, expected batch 64): `privtune tune` recovers **50 %**" in page
    assert "(bbc, 1,000 private pairs, 300 reported (10 decoded), 2 epochs per trial, expected batch 128): `privtune tune` recovers **25 %**" in page


def test_the_generation_section_gives_a_second_task_its_own_table(make_benchmarks, tmp_path):
    (tmp_path / "generation").mkdir()
    zero_shot = dict(bleu=4.5, chrf=20.0, rouge_l=15.0, perplexity=30.0, scored_rows=100, epsilon=0.0, seconds=60.0)
    (tmp_path / "generation" / "generation-20260101-000000.json").write_text(json.dumps(
        {"config": {"private": 1725, "reported": 300, "task": "bbc"}, "cells": {"zero-shot": zero_shot},
         "started": "2026-01-01"}))
    page = make_benchmarks.render_page(tmp_path)
    chitchat, _, bbc = page.partition("### BBC headlines")
    assert "| zero-shot model (no training) | – | – | – |" in chitchat  # not run on chitchat
    assert "| zero-shot model (no training) | – | – | 300 (100) | 4.50 |" in bbc


def test_fashion_seeds_of_one_cell_are_averaged(make_benchmarks, tmp_path):
    folder = tmp_path / "fashion_mnist"
    folder.mkdir()
    run = {"cell": "default", "test_accuracy": 0.84, "certificate_epsilon": 1.0, "wall_s": 120.0, "n_private": 58000,
           "n_public": 2000, "n_test": 10000, "features_l2_normalised": True}
    (folder / "default_eps1.json").write_text(json.dumps(run))
    (folder / "default_eps1_seed1.json").write_text(json.dumps(run | {"test_accuracy": 0.86}))
    page = make_benchmarks.render_page(tmp_path)
    assert "85.0 ± 1.4 % (2 seeds: 84.0, 86.0; ε 1;" in page


@pytest.mark.parametrize("other_accuracy, verdict", [(0.895, True), (0.91, False)])
def test_another_backbones_stage_cells_are_a_sentence_against_lite0s(make_benchmarks, tmp_path, other_accuracy,
                                                                      verdict):
    folder = tmp_path / "fashion_mnist"
    (folder / "stages").mkdir(parents=True)
    (folder / "lite2-stages").mkdir()
    run = {"cell": "default", "epsilon": 3.0, "test_accuracy": 0.894, "certificate_epsilon": 3.0, "wall_s": 60.0,
           "n_private": 58000, "n_public": 2000, "n_test": 10000, "image_size": 128}
    (folder / "default_eps3.json").write_text(json.dumps(run | {"test_accuracy": 0.88}))
    (folder / "stages" / "default_eps3.json").write_text(json.dumps(run))
    (folder / "lite2-stages" / "default_eps3.json").write_text(
        json.dumps(run | {"test_accuracy": other_accuracy, "model": "efficientnet-lite2"}))
    page = make_benchmarks.render_page(tmp_path)
    points = f"{100 * (other_accuracy - 0.894):+.1f}"
    assert (f"`--model efficientnet-lite2` (files in `lite2-stages/`; in brackets the points gained over "
            f"EfficientNet-Lite0's): at ε = 3 {100 * other_accuracy:.1f} % ({points})") in page
    assert ("does not reach the head" in page) is verdict
    # the other backbone's cell is not one of the table's (Lite0's) cells
    assert "| 3 | 88.0 % (" in page


def test_the_generation_speed_table_reads_the_newest_speed_file(make_benchmarks, tmp_path):
    folder = tmp_path / "generation"
    folder.mkdir()

    def cell(mode, method, eps, rss):
        return {"mode": mode, "method": method, "examples_per_second": eps, "peak_rss_mib": rss}

    run = {"config": {"model": "smollm2-135m", "micro_batch": 8, "max_length": 64, "speed_steps": 4},
           "started": "2026-01-02", "machine": {"cpus": 2, "torch_threads": 2, "load_before": 0.5},
           "cells": [cell("lora", "nonprivate", 10.0, 1000.0), cell("lora", "dp", 8.5, 1100.0),
                     cell("full", "nonprivate", 4.0, 2000.0), cell("full", "dp", 2.0, 2400.0)]}
    (folder / "speed-20260102-000000.json").write_text(json.dumps(run))
    (folder / "speed-20260101-000000.json").write_text(json.dumps(run | {"started": "2026-01-01", "cells": []}))
    page = make_benchmarks.render_page(tmp_path)
    assert "| lora | 10.00 | 8.50 | 0.85× | 1,000 MiB | 1,100 MiB | 1.10× |" in page
    assert "| full | 4.00 | 2.00 | 0.50× | 2,000 MiB | 2,400 MiB | 1.20× |" in page


def test_fixed_fashion_settings_are_a_table_with_the_same_plan_pairs(make_benchmarks, tmp_path):
    folder = tmp_path / "fashion_mnist"
    (folder / "fixed").mkdir(parents=True)
    (folder / "stages").mkdir()
    hp = {"steps": 43, "learning_rate": 0.05, "backbone_lr_scale": 1.0, "clipping": "flat", "optimizer": "adam",
          "noise_multiplier": 1.08}
    run = {"cell": "fixed", "epsilon": 3.0, "certificate_epsilon": 3.0, "wall_s": 60.0, "image_size": 128,
           "device": "NVIDIA H200", "n_private": 58000, "n_public": 2000, "n_test": 10000, "train_seconds": 1.0}
    (folder / "fixed" / "fixed-last-layer-lr0.05-a1-e3_eps3.json").write_text(json.dumps(
        run | {"mode": "last-layer", "test_accuracy": 0.846, "public_accuracy": 0.857, "hyperparameters": hp}))
    (folder / "fixed" / "fixed-bitfit-lr0.05-a0.1-e3_eps3.json").write_text(json.dumps(
        run | {"mode": "bitfit", "test_accuracy": 0.858, "public_accuracy": 0.873, "train_seconds": 173.0,
               "examples_per_second_not_private": 1021.4, "hyperparameters": hp | {"backbone_lr_scale": 0.1}}))
    tuned = {"cell": "default", "epsilon": 3.0, "test_accuracy": 0.895, "certificate_epsilon": 3.0, "wall_s": 9.0,
             "image_size": 128, "hyperparameters": {"steps": 142, "learning_rate_initial": 0.3,
                                                    "clipping": "automatic"}}
    (folder / "stages" / "default_eps3.json").write_text(json.dumps(tuned))
    page = make_benchmarks.render_page(tmp_path)
    assert ("| bitfit | 0.05 | 0.1 | flat, adam | 43 | 1.08 | 87.3 % | 85.8 % | NVIDIA H200, 128 | 2.9 min | "
            "1,021 |") in page
    assert "| last-layer | 0.05 | 1 | flat, adam | 43 | 1.08 | 85.7 % | 84.6 % | NVIDIA H200, 128 | 1 s | – |" in page
    assert "reaches 85.8 % against the head alone's 84.6 % (+1.2 points)" in page
    assert ("The best run that trains the backbone reaches 85.8 % (-3.7 points against `privtune tune "
            "--image-features stages` at ε = 3, whose head trains for 142 steps at η = 0.3 with automatic "
            "clipping)") in page


def test_every_fashion_column_says_what_it_costs_when_not_run(make_benchmarks):
    assert {cell for cell, _ in make_benchmarks.FASHION_COLUMNS} <= set(make_benchmarks.FASHION_NOT_RUN)
