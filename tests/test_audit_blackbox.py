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


def test_image_data_are_refused_with_what_the_audit_takes(files, tmp_path, capsys):
    """The audit's canaries are texts: an image folder is one clear error, which says that the white-box audit
    reads only the number of rows."""
    Image = pytest.importorskip("PIL.Image")
    for cls in ("cat", "dog"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        Image.new("RGB", (6, 6)).save(tmp_path / "imgs" / cls / "0.png")
    for extra in ([], ["--no-blackbox"]):
        rc = main(["audit", "--data", str(tmp_path / "imgs"), "--labels", "cat,dog", "--epsilon", "8",
                   "--canaries", "20", "--public-data", "--quiet", *extra])
        err = capsys.readouterr().err
        assert rc == 2 and len(err.strip().splitlines()) == 1
        assert "`data` holds image data" in err and "white-box audit (--no-blackbox) reads only" in err


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
    from privtune.engine import PrivateGradient

    orig = PrivateGradient.release

    def release_without_noise(self):
        saved, self.noise_multiplier = self.noise_multiplier, 0.0
        try:
            return orig(self)
        finally:
            self.noise_multiplier = saved

    monkeypatch.setattr(PrivateGradient, "release", release_without_noise)
    rc = main(["audit", "--data", str(files["train"]), "--labels", "0,1", "--epsilon", "1", "--delta", "1e-3", "--steps", "5",
               "--batch-size", "60", "--sampling", "full_batch", "--canaries", "500", "--no-blackbox", "--seed", "0",
               "--quiet"])
    out = capsys.readouterr().out
    assert rc == 1 and "VIOLATION" in out
