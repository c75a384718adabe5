"""`tune(max_length=...)` / `privtune tune --max-length`: the public token length reaches the classifier every trial
and the final run read, and the released model keeps it; a bad value is one clear error before anything is charged."""

from __future__ import annotations

import pytest

import privtune
from privtune.errors import InvalidParameterError
from privtune.models import load_classifier
from privtune.models.testing import make_toy_text_files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("tune-max-length"), {"train": ("train.tsv", 60, 0),
                                                                          "public": ("pub.tsv", 20, 1)})


def test_the_token_length_reaches_the_released_classifier(files, tmp_path):
    r = privtune.tune(files["train"], public_eval_data=files["public"], model=str(files["model"]), mode="bitfit",
                      epsilon=3, delta=1e-3, labels=["0", "1"], seed=0, quiet=True, max_length=6,
                      ledger=f"sqlite:///{tmp_path / 'l.db'}", output_dir=tmp_path / "run")
    assert r.model.max_length == 6
    assert load_classifier(tmp_path / "run" / "model").max_length == 6
    assert load_classifier(files["model"]).max_length > 6  # not the model's own default


@pytest.mark.parametrize("bad", [1, 0, "long", 2.5])
def test_a_bad_token_length_is_refused_before_any_charge(files, tmp_path, bad):
    with pytest.raises(InvalidParameterError, match="max_length"):
        privtune.tune(files["train"], public_eval_data=files["public"], model=str(files["model"]), epsilon=3,
                      delta=1e-3, labels=["0", "1"], quiet=True, max_length=bad,
                      ledger=f"sqlite:///{tmp_path / 'l.db'}", output_dir=tmp_path / "run")
    assert not (tmp_path / "l.db").exists() and not (tmp_path / "run").exists()
