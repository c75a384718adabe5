"""`--max-length` beyond the model's position embeddings is refused before the ledger reservation (it would
fail inside the backbone after the data was read, and fail again on every --resume)."""

from __future__ import annotations

import pytest

from privtune.cli import main
from privtune.errors import UnknownDatasetError
from privtune.ledger import Ledger
from privtune.models import load_classifier
from privtune.models.classifier import max_text_positions
from privtune.models.testing import make_tiny_text_model, make_toy_text_files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("maxlen"), {"train": ("train.tsv", 40, 0)})


def test_train_max_length_beyond_the_positions_is_refused_before_the_reservation(files, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'l.db'}"
    rc = main(["train", "--data", str(files["train"]), "--model", str(files["model"]), "--labels", "0,1", "--mode",
               "last-layer", "--epsilon", "1", "--delta", "1e-3", "--steps", "2", "--batch-size", "10",
               "--max-length", "100000", "--ledger", url, "--output", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert "--max-length 64 or less" in err
    with pytest.raises(UnknownDatasetError):  # nothing registered, nothing reserved
        Ledger(url).status(files["train"])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("arch, positions", [("bert", 64), ("roberta", 63), ("gpt2", 64)])
def test_positions_account_for_the_architecture_offset(tmp_path, arch, positions):
    from transformers import AutoConfig

    path = make_tiny_text_model(tmp_path / arch, arch=arch)
    assert max_text_positions(AutoConfig.from_pretrained(str(path))) == positions
    clf = load_classifier(path, max_length=positions, pooling="mean")  # the limit itself is accepted
    assert clf.max_length == positions
    long_text = " ".join(["good"] * 500)
    assert clf.encode_texts([long_text])["input_ids"].shape[1] == positions
    clf(**clf.encode_texts([long_text]))  # the backbone reads a text of the limit's length
    assert load_classifier(path, pooling="mean").max_length == positions  # the default (128) never exceeds it
