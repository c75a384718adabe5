"""bench/fashion_mnist.py's fixed cell: its settings are read, named and refused at the command line, before any
data or model is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import script_module

BENCH = Path(__file__).resolve().parent.parent / "bench" / "fashion_mnist.py"


@pytest.fixture(scope="module")
def bench():
    with script_module(BENCH, "bench_fashion_mnist") as module:
        yield module


def test_fixed_settings_are_parsed_with_flat_clipping_and_adam_by_default(bench):
    plain, tuned = bench.parse_fixed("bitfit:5e-3:1:3, last-layer:0.3:1:10:automatic:adamw")
    assert plain == {"mode": "bitfit", "learning_rate": 5e-3, "backbone_lr_scale": 1.0, "epochs": 3.0,
                     "clipping": "flat", "optimizer": "adam"}
    assert tuned["clipping"] == "automatic" and tuned["optimizer"] == "adamw"
    # a default is left out of the file name, so a setting keeps its name when the defaults are spelled out
    assert bench.fixed_key(plain) == "fixed-bitfit-lr0.005-a1-e3"
    assert bench.fixed_key(bench.parse_fixed("bitfit:5e-3:1:3:flat:adam")[0]) == "fixed-bitfit-lr0.005-a1-e3"
    assert bench.fixed_key(tuned) == "fixed-last-layer-lr0.3-a1-e10-automatic-adamw"


@pytest.mark.parametrize("spec, says", [
    ("lora:1e-3:1:3", "MODE last-layer, bitfit or full"),
    ("full:1e-2:0.1", "MODE:η:α:EPOCHS"),
    ("full:x:0.1:3", "must be numbers"),
    ("full:1e-2:0.1:3:clipped", "clipping is one of flat, automatic"),
])
def test_a_bad_fixed_setting_is_one_clear_error(bench, spec, says):
    with pytest.raises(SystemExit) as refused:
        bench.parse_fixed(spec)
    assert says in str(refused.value) and repr(spec) in str(refused.value)


def test_the_fixed_cell_without_settings_is_refused_before_any_data_is_read(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--cells", "fixed", "--results", str(tmp_path)])
    assert "needs its settings: --fixed" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_a_cells_rerun_starts_a_fresh_ledger(bench, tmp_path):
    run = tmp_path / "runs" / "default_last-layer_eps3"
    run.parent.mkdir()
    for spent in ("default_last-layer_eps3.db", "default_last-layer_eps3.db.key"):
        (run.parent / spent).write_text("spent")
    assert bench._fresh_ledger(run) == f"sqlite:///{run}.db"
    assert not any(run.parent.iterdir())
