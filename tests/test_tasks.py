"""privtune.tasks: the task seam. Text and image classification sit behind one interface; the training run
loads its evaluation split and builds its model through the task its training data's input kind picks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from privtune import training
from privtune.data import ImageDataset, TextDataset
from privtune.errors import DataError
from privtune.models.testing import make_toy_text_dataset, make_toy_text_files
from privtune.tasks import TASKS, ImageClassification, TextClassification, task_for


def _idx(path, array, magic=None):
    a = np.ascontiguousarray(array, dtype=np.uint8)
    magic = (0x0800 | a.ndim) if magic is None else magic
    path.write_bytes(magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in a.shape) + a.tobytes())
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("tasks"), {"train": ("train.tsv", 40, 0),
                                                                   "dev": ("dev.tsv", 20, 1)})


def test_the_input_kind_picks_the_task():
    assert isinstance(task_for(make_toy_text_dataset(8)), TextClassification)
    images = ImageDataset(images=[np.zeros((4, 4), np.uint8)] * 2, labels=[0, 1], num_labels=2)
    assert isinstance(task_for(images), ImageClassification)
    assert {t.kind for t in TASKS.values()} == set(TASKS)

    class Audio:
        kind = "audio"

    with pytest.raises(DataError, match="audio"):
        task_for(Audio())


def test_image_classification_loads_idx_images_and_refuses_text(tmp_path, files):
    rng = np.random.default_rng(0)
    images = _idx(tmp_path / "train-images-idx3-ubyte", rng.integers(0, 256, size=(6, 4, 5)))
    _idx(tmp_path / "train-labels-idx1-ubyte", np.array([0, 1, 2, 0, 1, 2]))
    split = ImageClassification().load_split(images, "data", num_labels=3)
    assert isinstance(split, ImageDataset) and split.labels == [0, 1, 2, 0, 1, 2]
    with pytest.raises(DataError, match="image-classification"):
        ImageClassification().load_split(files["train"], "eval_data", num_labels=2)
    with pytest.raises(DataError, match="text-classification"):
        TextClassification().load_split(images, "eval_data", num_labels=3)


def test_text_task_evaluates_like_the_loop_and_predicts_the_classes(files):
    task = TextClassification()
    clf = task.build_model(files["model"], num_labels=2, seed=0)
    dev = task.load_split(files["dev"], "eval_data", num_labels=2)
    assert isinstance(dev, TextDataset)
    got, loop = task.evaluate(clf, dev), training.evaluate(clf, dev)
    assert got["accuracy"] == pytest.approx(loop["accuracy"]) and got["loss"] == pytest.approx(loop["loss"])
    assert got["n"] == len(dev)
    predicted = task.predict(clf, dev)
    classes = clf.predict_logits(dev).argmax(1).tolist()
    names = getattr(clf, "label_names", None)
    assert predicted == ([names[c] for c in classes] if names is not None else classes)
    batch = task.batch(clf, dev, torch.tensor([0, 2]))
    assert batch["labels"].tolist() == [dev.labels[0], dev.labels[2]]
    losses = task.per_example_loss(clf, batch)
    logits = clf.predict_logits(dev)[[0, 2]]
    torch.testing.assert_close(losses, torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="none"),
                               atol=1e-5, rtol=1e-5)


def test_train_loads_its_evaluation_split_through_the_task(files, tmp_path, monkeypatch):
    seen = []
    real = TextClassification.load_split

    def spy(self, data, what, **kw):
        seen.append((type(self).__name__, what))
        return real(self, data, what, **kw)

    monkeypatch.setattr(TextClassification, "load_split", spy)
    training.train(files["train"], eval_data=files["dev"], model=files["model"], mode="last-layer", epsilon=2.0,
                   delta=1e-3, steps=2, batch_size=20, ledger=f"sqlite:///{tmp_path / 'l.db'}", progress=False,
                   labels=[0, 1])
    assert seen == [("TextClassification", "eval_data")]
