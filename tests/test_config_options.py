"""privtune.config: YAML files merged under flags, validation, effective config, `privtune config`."""

from __future__ import annotations

import pytest

from privtune.cli import main
from privtune.config import (
    SCHEMAS,
    check_config_file,
    load_effective_config,
    resolve_options,
    save_effective_config,
    template,
)
from privtune.errors import InvalidParameterError, PrivtuneError


def _write(tmp_path, text, name="run.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_flags_override_file_and_file_fills_the_rest(tmp_path):
    cfg = _write(tmp_path, "data: a.tsv\nepsilon: 2\ndelta: 1e-5\nmode: bitfit\nbatch_size: 64\n")
    out = resolve_options("train", cfg, {"epsilon": 8.0, "mode": None, "steps": 10})
    assert out == {"data": "a.tsv", "epsilon": 8.0, "delta": 1e-5, "mode": "bitfit", "batch_size": 64, "steps": 10}
    assert isinstance(out["delta"], float) and isinstance(out["batch_size"], int)


def test_no_file_only_flags(tmp_path):
    assert resolve_options("tune", None, {"strategy": "hyperfree", "config": "x"}) == {"strategy": "hyperfree"}


def test_scientific_notation_without_dot_is_a_number(tmp_path):
    cfg = _write(tmp_path, "delta: 1e-5\nlearning_rate: 3E-4\n")
    out = resolve_options("train", cfg, {})
    assert out["delta"] == pytest.approx(1e-5) and out["learning_rate"] == pytest.approx(3e-4)


def test_unknown_key_names_key_and_closest(tmp_path):
    cfg = _write(tmp_path, "epsilon: 1.0\nlearnig_rate: 0.1\n")
    with pytest.raises(InvalidParameterError) as ei:
        resolve_options("train", cfg, {})
    msg = str(ei.value)
    assert "learnig_rate" in msg and "Did you mean 'learning_rate'" in msg and "run.yaml" in msg


def test_dashed_key_suggests_snake_case(tmp_path):
    cfg = _write(tmp_path, "eval-data: dev.tsv\n")
    with pytest.raises(InvalidParameterError, match="Did you mean 'eval_data'"):
        resolve_options("tune", cfg, {})


def test_key_of_other_command_is_explained(tmp_path):
    cfg = _write(tmp_path, "strategy: hyperfree\n")
    with pytest.raises(InvalidParameterError, match="option of `privtune tune`"):
        resolve_options("train", cfg, {})


def test_train_only_keys_are_refused_by_tune(tmp_path):
    cfg = _write(tmp_path, "resume: true\n")
    with pytest.raises(InvalidParameterError, match="option of `privtune train`"):
        resolve_options("tune", cfg, {})


@pytest.mark.parametrize(
    "text, key",
    [
        ("epsilon: one\n", "epsilon"),
        ("epsilon: -1\n", "epsilon"),
        ("delta: 1.5\n", "delta"),
        ("steps: 10.5\n", "steps"),
        ("batch_size: true\n", "batch_size"),
        ("quiet: 'yes please'\n", "quiet"),
        ("mode: bitfitt\n", "mode"),
        ("data: [a, b]\n", "data"),
        ("epsilon: .nan\n", "epsilon"),
    ],
)
def test_wrong_types_and_values(tmp_path, text, key):
    cfg = _write(tmp_path, text)
    with pytest.raises(InvalidParameterError) as ei:
        resolve_options("train", cfg, {})
    assert f"`{key}`" in str(ei.value)
    assert isinstance(ei.value, PrivtuneError)


def test_choice_typo_suggests(tmp_path):
    cfg = _write(tmp_path, "strategy: linear_scaling\n")
    with pytest.raises(InvalidParameterError, match="Did you mean 'linear-scaling'"):
        resolve_options("tune", cfg, {})


def test_bad_flag_value_is_rejected_too():
    with pytest.raises(InvalidParameterError, match="command line: `epsilon`"):
        resolve_options("train", None, {"epsilon": 0.0})


def test_non_schema_flags_pass_through():
    assert resolve_options("train", None, {"json": True}) == {"json": True}


def test_epochs_and_steps_conflict_in_file(tmp_path):
    cfg = _write(tmp_path, "epochs: 2\nsteps: 100\n")
    with pytest.raises(InvalidParameterError, match="`epochs` or `steps`, not both"):
        resolve_options("train", cfg, {})


def test_flag_epochs_replaces_file_steps(tmp_path):
    cfg = _write(tmp_path, "steps: 100\n")
    assert resolve_options("train", cfg, {"epochs": 2}) == {"epochs": 2}


def test_sections_per_command(tmp_path):
    cfg = _write(tmp_path, "epsilon: 1.0\ntrain:\n  mode: full\ntune:\n  strategy: hyperfree\n  mode: auto\n")
    assert resolve_options("train", cfg, {}) == {"epsilon": 1.0, "mode": "full"}
    assert resolve_options("tune", cfg, {}) == {"epsilon": 1.0, "strategy": "hyperfree", "mode": "auto"}


def test_null_means_unset_and_empty_file(tmp_path):
    assert resolve_options("train", _write(tmp_path, "model: null\n"), {}) == {}
    assert resolve_options("train", _write(tmp_path, "", "empty.yaml"), {}) == {}


@pytest.mark.parametrize("text", ["- a\n- b\n", "epsilon: [1\n"])
def test_not_a_mapping_or_not_yaml(tmp_path, text):
    with pytest.raises(InvalidParameterError, match="config"):
        resolve_options("train", _write(tmp_path, text), {})


def test_missing_file_and_bad_command(tmp_path):
    with pytest.raises(InvalidParameterError, match="does not exist"):
        resolve_options("train", tmp_path / "nope.yaml", {})
    with pytest.raises(InvalidParameterError, match="Did you mean 'train'"):
        resolve_options("trian", None, {})


@pytest.mark.parametrize("command", ["train", "tune"])
def test_template_is_valid_and_mentions_every_key(tmp_path, command):
    text = template(command)
    for key in SCHEMAS[command]:
        assert f"{key}:" in text
    p = _write(tmp_path, text)
    opts = check_config_file(p, command)[command]
    assert opts["epsilon"] == 1.0 and opts["delta"] == pytest.approx(1e-5)
    # uncommenting every example gives a valid file (the examples are valid values); drop `steps`
    # because the template shows both `epochs` and `steps`, which exclude each other
    keys = tuple(f"# {k}:" for k in SCHEMAS[command]) + ("#   ",)
    lines = [ln[2:] if ln.startswith(keys) else ln for ln in text.splitlines()]
    full = _write(tmp_path, "\n".join(ln for ln in lines if not ln.startswith("steps:")), "full.yaml")
    opts = check_config_file(full, command)[command]
    assert set(opts) == set(SCHEMAS[command]) - {"steps"}


def test_save_effective_config_round_trips(tmp_path):
    from pathlib import Path

    opts = {"data": Path("a.tsv"), "epsilon": 1.0, "delta": 1e-5, "mode": "bitfit", "steps": 5, "quiet": True}
    path = save_effective_config(opts, tmp_path / "run", command="train")
    assert path == tmp_path / "run" / "config.yaml"
    text = path.read_text()
    assert text.startswith("#") and "privtune train --config" in text
    assert resolve_options("train", path, {}) == {**opts, "data": "a.tsv"}
    assert load_effective_config(tmp_path / "run")["steps"] == 5
    assert load_effective_config(tmp_path / "missing") == {}


def test_cli_config_init_and_check(tmp_path, capsys):
    p = tmp_path / "t.yaml"
    assert main(["config", "init", "--command", "train", str(p)]) == 0
    assert p.read_text() == template("train")
    assert main(["config", "init", str(p)]) == 2  # refuses to overwrite
    assert "already exists" in capsys.readouterr().err
    assert main(["config", "check", "--command", "train", str(p)]) == 0
    assert "valid for `privtune train`" in capsys.readouterr().out
    bad = _write(tmp_path, "epsilon: 1\nstratgy: hyperfree\n", "bad.yaml")
    assert main(["config", "check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Did you mean 'strategy'" in err


def test_explicit_cli_values_skips_defaults():
    import click
    from click.testing import CliRunner

    from privtune.config import explicit_cli_values

    seen = {}

    @click.command()
    @click.option("--epsilon", type=float, default=1.0)
    @click.option("--mode", default="bitfit")
    @click.option("--config", default=None)
    def cmd(epsilon, mode, config):
        seen.update(explicit_cli_values(click.get_current_context()))

    res = CliRunner().invoke(cmd, ["--mode", "full", "--config", "x.yaml"])
    assert res.exit_code == 0, res.output
    assert seen == {"mode": "full"}


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path, capsys):
    """PyYAML keeps the last of two `epsilon:` lines silently: a run once spent ε = 50 from such a file."""
    cfg = _write(tmp_path, "data: a.tsv\nepsilon: 1\nmode: bitfit\nepsilon: 50\n")
    with pytest.raises(InvalidParameterError, match="key 'epsilon' is given twice \\(lines 2 and 4\\)"):
        resolve_options("train", cfg, {})
    section = _write(tmp_path, "tune:\n  trials: 4\n  trials: 8\n", name="s.yaml")
    with pytest.raises(InvalidParameterError, match="'trials' is given twice"):
        check_config_file(section)
    # a flow mapping puts both on one line
    for i, text in enumerate(("{epsilon: 1, epsilon: 50}\n", "train: {epsilon: 1, mode: full, epsilon: 50}\n")):
        flow = _write(tmp_path, text, name=f"flow{i}.yaml")
        with pytest.raises(InvalidParameterError, match="key 'epsilon' is given twice on line 1"):
            resolve_options("train", flow, {})
    assert main(["train", "--config", str(cfg), "--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "given twice" in err and not (tmp_path / "run").exists()
    # the same key at the top level and in a command's section is the documented override, not a duplicate
    ok = _write(tmp_path, "epsilon: 1\ntune:\n  epsilon: 2\n", name="ok.yaml")
    assert resolve_options("tune", ok, {})["epsilon"] == 2.0


def test_an_alias_bomb_and_an_oversized_file_get_one_short_error(tmp_path, capsys):
    levels = ["a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]" for i in range(6)]
    bomb = _write(tmp_path, "\n".join(levels) + "\nlabels: *g\n", name="bomb.yaml")
    assert main(["config", "check", str(bomb)]) == 2
    err = capsys.readouterr().err
    assert "alias *a" in err and "line 2" in err and len(err) < 300, err
    anchored = _write(tmp_path, "epsilon: &e 1\ndelta: 1e-5\n", name="anchor.yaml")  # an anchor alone is harmless
    assert resolve_options("train", anchored, {})["epsilon"] == 1.0
    big = _write(tmp_path, "labels: [" + ", ".join(["1"] * 200_000) + "]\n", name="big.yaml")
    assert main(["config", "check", str(big)]) == 2
    err = capsys.readouterr().err
    assert "at most 256 KiB" in err and len(err) < 300, err
    # a long value that fits is shown cut, not whole
    long_value = _write(tmp_path, "labels: [" + ", ".join([f"[{i}]" for i in range(2000)]) + "]\n", name="long.yaml")
    assert main(["config", "check", "--command", "train", str(long_value)]) == 2
    err = capsys.readouterr().err
    assert "`labels` must be" in err and len(err) < 400, err
