"""Data loaders: TSV/CSV/JSONL with column detection, HF datasets, image folders, embedded SST-2, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from privtune.data import (
    ImageDataset,
    TextDataset,
    embedded_sst2,
    load_dataset,
    load_image_folder,
    load_text_dataset,
)
from privtune.errors import DataError, PrivtuneError


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_tsv_autodetect(tmp_path):
    p = write(tmp_path / "a.tsv", "label\tsentence\n0\tbad movie\n1\tgood film\n1\tgreat\n")
    ds = load_text_dataset(p)
    assert isinstance(ds, TextDataset)
    assert ds.texts == ["bad movie", "good film", "great"]
    assert ds.labels == [0, 1, 1]
    assert ds.num_labels == 2 and ds.text_column == "sentence" and ds.label_column == "label"
    assert ds.source.endswith("a.tsv")


def test_csv_quoted_commas_and_override(tmp_path):
    p = write(tmp_path / "a.csv", 'id,review,stars\n1,"good, really",2\n2,"bad",0\n3,meh,1\n')
    ds = load_text_dataset(p, text_column="review", label_column="stars")
    assert ds.texts[0] == "good, really"
    assert ds.labels == [2, 0, 1] and ds.num_labels == 3


def test_jsonl_and_string_labels(tmp_path):
    rows = [{"text": "fine", "label": "pos"}, {"text": "awful", "label": "neg"}, {"text": "ok", "label": "pos"}]
    p = write(tmp_path / "a.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    ds = load_text_dataset(p)
    assert ds.label_names == ["neg", "pos"] and ds.labels == [1, 0, 1]
    # evaluation data maps its names onto the training label set
    ev = load_text_dataset(p, label_names=["pos", "neg"])
    assert ev.labels == [0, 1, 0]


def test_two_column_file_without_standard_names(tmp_path):
    p = write(tmp_path / "a.tsv", "y_true\tbody\n1\thello there\n0\tbye\n")
    ds = load_text_dataset(p, text_column="body")
    assert ds.labels == [1, 0] and ds.label_column == "y_true"


def test_unlabelled_allowed_for_prediction(tmp_path):
    p = write(tmp_path / "a.tsv", "sentence\tid\nhello\t1\nbye\t2\n")
    ds = load_text_dataset(p, require_labels=False, text_column="sentence", label_column=None)
    assert ds.texts == ["hello", "bye"]


@pytest.mark.parametrize(
    "content, kwargs, match",
    [
        ("label\tsentence\n", {}, "no examples"),
        ("", {}, "empty"),
        ("label\tsentence\n0\ta\n1\tb\n", {"text_column": "txt"}, "'txt'.*not found"),
        ("foo\tbar\tbaz\n1\t2\t3\n", {}, "which column holds the text"),
        ("label\tsentence\n0\ta\n-1\tb\n", {}, "out of range"),
        ("label\tsentence\n0\ta\n5\tb\n", {"num_labels": 2}, "out of range"),
        ("label\tsentence\n0\ta\n\tb\n", {}, "empty value in label column"),
        ("label\tsentence\n0\ta\tb\n", {}, "3 fields"),
    ],
)
def test_bad_text_files(tmp_path, content, kwargs, match):
    p = write(tmp_path / "bad.tsv", content)
    with pytest.raises(DataError, match=match):
        load_text_dataset(p, **kwargs)


def test_missing_label_column_is_an_error_for_training(tmp_path):
    p = write(tmp_path / "a.tsv", "sentence\tother\nhello\tx y\n")
    with pytest.raises(DataError, match="no label column"):
        load_text_dataset(p, text_column="sentence")


def test_unreadable_and_missing_files(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_text_dataset(tmp_path / "nope.tsv")
    (tmp_path / "bin.tsv").write_bytes(b"\xff\xfe\x00label")
    with pytest.raises(DataError, match="UTF-8"):
        load_text_dataset(tmp_path / "bin.tsv")
    write(tmp_path / "a.parquet", "x")
    with pytest.raises(DataError, match="extension"):
        load_text_dataset(tmp_path / "a.parquet")
    write(tmp_path / "bad.jsonl", '{"text": "a", "label": 0}\n{not json}\n')
    with pytest.raises(DataError, match="line 2"):
        load_text_dataset(tmp_path / "bad.jsonl")
    assert issubclass(DataError, PrivtuneError) and issubclass(DataError, ValueError)


def test_hf_datasets_object():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(
        {"text": ["a", "b", "c"], "label": [0, 1, 0]},
        features=datasets.Features({"text": datasets.Value("string"),
                                    "label": datasets.ClassLabel(names=["neg", "pos"])}),
    )
    out = load_text_dataset(ds)
    assert out.texts == ["a", "b", "c"] and out.labels == [0, 1, 0]
    assert out.label_names == ["neg", "pos"] and out.num_labels == 2
    with pytest.raises(DataError, match="split"):
        load_text_dataset(datasets.DatasetDict({"train": ds}))
    with pytest.raises(DataError, match="empty"):
        load_text_dataset(ds.select([]))


def test_image_folder(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    for cls, color in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (6, 6), color).save(tmp_path / "imgs" / cls / f"{i}.png")
    ds = load_image_folder(tmp_path / "imgs")
    assert isinstance(ds, ImageDataset)
    assert ds.label_names == ["cat", "dog"] and ds.labels == [0, 0, 1, 1]
    assert ds.load_image(3).size == (6, 6)
    assert isinstance(load_dataset(tmp_path / "imgs"), ImageDataset)
    (tmp_path / "imgs" / "dog" / "broken.png").write_bytes(b"not an image")
    with pytest.raises(DataError, match="Cannot read image"):
        load_image_folder(tmp_path / "imgs")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no class sub-folders"):
        load_image_folder(tmp_path / "empty")


def test_unlabelled_images_load_for_prediction_only(tmp_path):
    """A folder of images without class sub-folders, or one image file, loads unlabelled where labels are not
    required (prediction); training data keep the class layout."""
    Image = pytest.importorskip("PIL.Image")
    flat = tmp_path / "flat"
    flat.mkdir()
    for name in ("b.png", "a.jpg"):
        Image.new("RGB", (6, 6), (0, 255, 0)).save(flat / name)
    (flat / "notes.txt").write_text("not an image")
    ds = load_dataset(flat, require_labels=False, label_names=["cat", "dog"])
    assert isinstance(ds, ImageDataset) and ds.labels is None and ds.label_names == ["cat", "dog"]
    assert [Path(p).name for p in ds.images] == ["a.jpg", "b.png"]  # sorted, images only
    one = load_dataset(flat / "b.png", require_labels=False)
    assert one.labels is None and [Path(p).name for p in one.images] == ["b.png"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no class sub-folders.*or the images to predict directly in it"):
        load_image_folder(tmp_path / "empty", require_labels=False)
    with pytest.raises(DataError, match="no class sub-folders. Put images"):
        load_dataset(flat, labels=["cat", "dog"])  # training: labels come from the class folders
    with pytest.raises(DataError, match="is a file; an image dataset is a folder"):
        load_dataset(flat / "b.png", labels=["cat", "dog"])
    with pytest.raises(DataError, match="Image file .* does not exist"):
        load_dataset(flat / "c.png", require_labels=False)
    (flat / "broken.png").write_bytes(b"not an image")
    with pytest.raises(DataError, match="Cannot read image"):
        load_dataset(flat, require_labels=False)


def test_embedded_sst2_subset():
    train, val, test = embedded_sst2()
    assert (len(train), len(val), len(test)) == (3000, 500, 872)
    assert set(train.texts).isdisjoint(val.texts)
    assert set(train.texts).isdisjoint(test.texts) and set(val.texts).isdisjoint(test.texts)
    for ds in (train, val, test):
        assert ds.num_labels == 2 and set(ds.labels) == {0, 1}
    # roughly balanced, as SST-2 is
    assert 0.4 < sum(train.labels) / len(train) < 0.65


def test_subset_keeps_label_space():
    ds = TextDataset(texts=["a", "b", "c"], labels=[0, 2, 1])
    sub = ds.subset([0, 2])
    assert sub.texts == ["a", "c"] and sub.labels == [0, 1] and sub.num_labels == 3


@pytest.mark.parametrize("fmt, content", [
    ("tsv", "label\tsentence\n0\tfine film\n1\t\n0\t   \n1\tgood\n"),
    ("csv", 'label,sentence\n0,fine film\n1,""\n0,"   "\n1,good\n'),
    ("jsonl", '{"label": 0, "sentence": "fine film"}\n{"label": 1, "sentence": ""}\n'
              '{"label": 0, "sentence": " \\t "}\n{"label": 1, "sentence": "good"}\n'),
])
def test_empty_or_blank_texts_are_refused_with_row_and_count_never_a_text(tmp_path, fmt, content):
    """docs/privacy-model.md lists "no empty text" among the checks made before anything is reserved."""
    p = write(tmp_path / f"blank.{fmt}", content)
    for require_labels in (True, False):  # training and prediction files alike
        with pytest.raises(DataError, match=r"row 2 has an empty text \(empty or only spaces; 2 row\(s\) affected\)"
                           ) as e:
            load_text_dataset(p, require_labels=require_labels)
        assert "fine film" not in str(e.value) and "good" not in str(e.value)


def test_in_memory_blank_texts_are_refused():
    with pytest.raises(DataError, match=r"`texts`: row 1 has an empty text .*1 row\(s\)"):
        TextDataset(texts=[" ", "ok"], labels=[0, 1])
