"""`--privacy-unit` on image data: a sidecar table names each image's unit (`units.tsv` in an image folder, with
a `file` column; `<IDX images file>.units.tsv`, one row per image in order); train end to end at the unit level."""

from __future__ import annotations

import json

import numpy as np
import pytest

from privtune.data import load_dataset
from privtune.engine.units import load_units
from privtune.errors import DataError
from privtune.training import train

Image = pytest.importorskip("PIL.Image")


def _folder(root, per_class=6):
    for cls, color in (("cat", (250, 10, 10)), ("dog", (10, 10, 250))):
        (root / cls).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (8, 8), tuple(max(0, c - 20 * i) for c in color)).save(root / cls / f"{i}.png")
    return root


def _table(path, rows):
    path.write_text("\n".join("\t".join(r) for r in rows) + "\n", encoding="utf-8")


def test_an_image_folder_names_its_units_in_units_tsv(tmp_path):
    root = _folder(tmp_path / "imgs")
    # owner o{i % 3}: each owner has images in both classes, listed in another order than the loader's
    _table(root / "units.tsv", [("owner", "file")] + [(f"o{i % 3}", f"{c}/{i}.png") for c in ("dog", "cat")
                                                       for i in range(6)])
    ds = load_dataset(str(root), labels=["cat", "dog"])
    units = load_units(str(root), "owner", len(ds), dataset=ds)
    assert units.num_units == 3
    owners = [f"o{int(img.rsplit('/', 1)[1][0]) % 3}" for img in ds.images]  # the loader's order: cat/0 … dog/5
    first = {}
    assert units.unit_of_row.tolist() == [first.setdefault(o, len(first)) for o in owners]


def test_train_on_an_image_folder_at_the_unit_level(tmp_path):
    from privtune.models.testing import make_tiny_image_model

    root = _folder(tmp_path / "imgs")
    _table(root / "units.tsv", [("file", "owner")] + [(f"{c}/{i}.png", f"o{i % 4}") for c in ("cat", "dog")
                                                       for i in range(6)])
    r = train(root, model=make_tiny_image_model(tmp_path / "vit"), mode="bitfit", epsilon=5.0, delta=1e-3, steps=2,
              batch_size=2, ledger=f"sqlite:///{tmp_path / 'l.db'}", output_dir=tmp_path / "run", seed=0,
              progress=False, labels=["cat", "dog"], privacy_unit="owner", max_rows_per_unit=2)
    cert = json.loads((tmp_path / "run" / "certificate.json").read_text())
    assert cert["neighbouring"] == "add/remove all rows of one owner"
    assert cert["events"][0]["sample_rate"] == pytest.approx(2 / 4)  # q over the 4 owners
    assert r.metrics["hyperparameters"]["privacy_unit"]["num_units"] == 4


def test_an_unlisted_image_or_a_folder_without_a_table_is_refused(tmp_path):
    root = _folder(tmp_path / "imgs")
    ds = load_dataset(str(root), labels=["cat", "dog"])
    with pytest.raises(DataError, match="has no columns"):  # no units table
        load_units(str(root), "owner", len(ds), dataset=ds)
    _table(root / "units.tsv", [("file", "owner")] + [(f"cat/{i}.png", "o1") for i in range(6)])
    with pytest.raises(DataError, match="6 image\\(s\\) of the folder are not listed") as err:
        load_units(str(root), "owner", len(ds), dataset=ds)
    assert "dog/" not in str(err.value) and "o1" not in str(err.value)
    _table(root / "units.tsv", [("file", "person")] + [(f"cat/{i}.png", "o1") for i in range(6)])
    with pytest.raises(DataError, match="'owner'.*not found"):
        load_units(str(root), "owner", len(ds), dataset=ds)


def test_idx_images_name_their_units_in_a_sidecar_table(tmp_path):
    import gzip

    def idx(array, magic):
        a = np.ascontiguousarray(array, dtype=np.uint8)
        return magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in a.shape) + a.tobytes()

    images = tmp_path / "train-images-idx3-ubyte.gz"
    with gzip.open(images, "wb") as f:
        f.write(idx(np.zeros((5, 4, 4)), 0x0803))
    with gzip.open(tmp_path / "train-labels-idx1-ubyte.gz", "wb") as f:
        f.write(idx(np.array([0, 1, 0, 1, 0]), 0x0801))
    ds = load_dataset(str(images), labels=[0, 1])
    _table(tmp_path / "train-images-idx3-ubyte.gz.units.tsv", [("writer",), ("w1",), ("w2",), ("w1",)])
    with pytest.raises(DataError, match="3 row\\(s\\) for 5 image"):
        load_units(str(images), "writer", len(ds), dataset=ds)
    _table(tmp_path / "train-images-idx3-ubyte.gz.units.tsv", [("writer",)] + [(f"w{i % 2}",) for i in range(5)])
    units = load_units(str(images), "writer", len(ds), dataset=ds)
    assert units.num_units == 2 and units.unit_of_row.tolist() == [0, 1, 0, 1, 0] and units.name == "writer"


@pytest.mark.parametrize("command", ["tune", "train"])
def test_an_image_split_sharing_a_unit_with_the_training_images_is_refused_before_any_charge(tmp_path, capsys,
                                                                                              command):
    """A public (tune) or reported (train) image folder whose units table names an owner of training images is
    refused before the ledger is touched; the same split with owners of its own is accepted."""
    from privtune.cli import main
    from privtune.ledger import Ledger
    from privtune.models.testing import make_tiny_image_model

    root = _folder(tmp_path / "imgs")
    _table(root / "units.tsv", [("file", "owner")] + [(f"{c}/{i}.png", f"o{i % 4}") for c in ("cat", "dog")
                                                       for i in range(6)])
    public = tmp_path / "pub"  # images of their own (no row in common with the training images)
    for cls, color in (("cat", (200, 60, 60)), ("dog", (60, 60, 200))):
        (public / cls).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (8, 8), tuple(c + 7 * i for c in color)).save(public / cls / f"{i}.png")
    model = make_tiny_image_model(tmp_path / "vit")
    split_flag = "--public-eval-data" if command == "tune" else "--eval-data"

    def run(owners, tag):
        _table(public / "units.tsv", [("file", "owner")] + [(f"{c}/{i}.png", owners(i)) for c in ("cat", "dog")
                                                             for i in range(3)])
        argv = [command, "--data", str(root), split_flag, str(public), "--model", str(model), "--labels", "cat,dog",
                "--mode", "last-layer", "--epsilon", "3", "--delta", "1e-2", "--privacy-unit", "owner", "--seed",
                "0", "--quiet", "--ledger", f"sqlite:///{tmp_path / (tag + '.db')}", "--output", str(tmp_path / tag)]
        if command == "train":
            argv += ["--steps", "2", "--batch-size", "2"]
        code = main(argv)
        return code, capsys.readouterr().err, tmp_path / (tag + ".db"), tmp_path / tag

    code, err, db, run_dir = run(lambda i: "o2" if i == 1 else f"p{i}", "shared")  # one image of owner o2
    assert code != 0 and "shares privacy units with the private training data" in err and "Traceback" not in err
    assert "o2" not in err and "Nothing was charged" in err
    assert not db.exists() or not Ledger(f"sqlite:///{db}").datasets()
    assert not (run_dir / "certificate.json").exists()
    code, err, _, run_dir = run(lambda i: f"p{i}", "own")
    assert code == 0, err
    assert json.loads((run_dir / "certificate.json").read_text())["neighbouring"] == "add/remove all rows of one owner"
