"""A PostgreSQL ledger password given in ``--ledger`` never reaches a file a run writes.

RUN_DIR is released, so ``config.yaml`` (and the private state of an unfinished ``tune``) hold the ledger URL
with its password removed (libpq then reads PGPASSWORD or ~/.pgpass), and ``--resume`` compares ledger URLs
without their passwords.  The end-to-end tests run against the real server of ``test_ledger_backends``
(the server trusts local connections, so it accepts the URL with any password).
"""

from __future__ import annotations

import json

import pytest

import privtune.hpo.backends as backends
from privtune.cli import main
from privtune.config import load_yaml, save_effective_config
from privtune.errors import InvalidParameterError
from privtune.hpo._resume import _check_resume_config
from privtune.hpo.tune import STATE_FILE
from privtune.ledger import mask_url, url_without_password
from privtune.models.testing import make_toy_text_files

SECRET = "S3cret-pw"


@pytest.mark.parametrize("url,expected", [
    ("postgresql://alice:S3cret-pw@db.internal:5432/ledger", "postgresql://alice@db.internal:5432/ledger"),
    ("postgresql://alice:S3cret-pw@/ledger?host=/tmp&port=5433", "postgresql://alice@/ledger?host=%2Ftmp&port=5433"),
    ("postgresql://alice@db/ledger?password=S3cret-pw&sslmode=require", "postgresql://alice@db/ledger?sslmode=require"),
    ("postgresql://alice:S3cret-pw@db:notaport/ledger", "postgresql://alice@db:notaport/ledger"),  # unparseable
    ("postgresql://alice@db/ledger", "postgresql://alice@db/ledger"),  # no password: as given
    ("sqlite:////tmp/my ledger.db", "sqlite:////tmp/my ledger.db"),
])
def test_url_without_password(url, expected):
    assert url_without_password(url) == expected


def test_mask_url_hides_a_password_query_parameter():
    assert SECRET not in mask_url(f"postgresql://alice@db/ledger?password={SECRET}&sslmode=require")


def test_config_yaml_has_no_ledger_password(tmp_path):
    url = f"postgresql://alice:{SECRET}@db.internal:5432/ledger"
    path = save_effective_config({"ledger": url, "mode": "last-layer"}, tmp_path, command="train")
    text = path.read_text()
    assert SECRET not in text and "password is not written" in text and "PGPASSWORD" in text
    assert load_yaml(path)["ledger"] == "postgresql://alice@db.internal:5432/ledger"
    # a URL without a password is written as given, without the comment
    save_effective_config({"ledger": "sqlite:///l.db"}, tmp_path, command="train")
    assert load_yaml(path)["ledger"] == "sqlite:///l.db" and "password" not in path.read_text()


def test_resume_compares_ledger_urls_without_passwords(tmp_path):
    url = f"postgresql://alice:{SECRET}@db/ledger"
    # the state of a run started with the password (also one written before passwords were removed) ...
    for stored in (url, url_without_password(url)):
        header = {"config": {"ledger": stored, "epsilon": 1.0}}
        # ... resumes with the same URL, with or without its password
        _check_resume_config(header, {"ledger": url, "epsilon": 1.0}, tmp_path / STATE_FILE)
        _check_resume_config(header, {"ledger": url_without_password(url), "epsilon": 1.0}, tmp_path / STATE_FILE)
        with pytest.raises(InvalidParameterError, match="ledger") as err:
            _check_resume_config(header, {"ledger": f"postgresql://alice:{SECRET}@other/ledger", "epsilon": 1.0},
                                 tmp_path / STATE_FILE)
        assert SECRET not in str(err.value)


# ----------------------------------------------------------------------------- end to end, real PostgreSQL


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_toy_text_files(tmp_path_factory.mktemp("pgpass"), {"train": ("train.tsv", 120, 0),
                                                                   "public": ("public.tsv", 30, 1),
                                                                   "dev": ("dev.tsv", 30, 2)})


def _with_password(url: str) -> str:
    assert url.startswith("postgresql://postgres@")
    return url.replace("postgres@", f"postgres:{SECRET}@", 1)


def _files_holding_secret(run_dir) -> list[str]:
    return [str(p.relative_to(run_dir)) for p in sorted(run_dir.rglob("*"))
            if p.is_file() and SECRET.encode() in p.read_bytes()]


def test_train_run_dir_holds_no_ledger_password(files, pg_url, tmp_path):  # noqa: F811
    out = tmp_path / "train"
    assert main(["train", "--data", str(files["train"]), "--labels", "0,1", "--eval-data", str(files["dev"]), "--model",
                 str(files["model"]), "--mode", "last-layer", "--epsilon", "3", "--delta", "1e-3", "--steps", "3",
                 "--batch-size", "40", "--ledger", _with_password(pg_url), "--output", str(out), "--seed", "0",
                 "--quiet"]) == 0
    assert (out / "certificate.json").is_file() and _files_holding_secret(out) == []
    assert load_yaml(out / "config.yaml")["ledger"] == url_without_password(_with_password(pg_url))


class _InterruptAt:
    """Replaces backends.fit; raises KeyboardInterrupt (Ctrl-C) on call number ``at``."""

    def __init__(self, monkeypatch, at):
        self.orig, self.calls, self.at = backends.fit, 0, at
        monkeypatch.setattr(backends, "fit", self)

    def __call__(self, *a, **k):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.orig(*a, **k)


def test_tune_interrupted_and_resumed_with_the_password_url(files, pg_url, tmp_path, monkeypatch, capsys):  # noqa: F811
    out = tmp_path / "tune"
    argv = ["tune", "--data", str(files["train"]), "--eval-data", str(files["dev"]), "--public-eval-data",
            str(files["public"]), "--model", str(files["model"]), "--mode", "last-layer", "--strategy",
            "linear-scaling", "--epsilon", "2", "--delta", "1e-3", "--ledger", _with_password(pg_url),
            "--output", str(out), "--seed", "0", "--quiet"]
    interrupt = _InterruptAt(monkeypatch, at=3)
    assert main(argv) == 130
    # the unfinished run's private state and its config.yaml hold the URL without the password
    assert (out / STATE_FILE).is_file() and _files_holding_secret(out) == []
    interrupt.at = None
    assert main(argv + ["--resume"]) == 0  # the same URL, with its password, resumes the run
    assert "resumed" in capsys.readouterr().out
    assert (out / "certificate.json").is_file() and not (out / STATE_FILE).exists()
    assert _files_holding_secret(out) == []
    text = (out / "config.yaml").read_text()
    assert "password is not written" in text
    assert json.loads((out / "metrics.json").read_text())["ledger_url"].count("***") == 1
