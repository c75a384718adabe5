"""The memorisation audit of a causal language model: digit canaries, their exposure (Carlini et al. 2019) on
toy models with a known answer, and ``privtune audit`` end to end on a tiny random LLaMA (one-run bound, DP
and NOT PRIVATE non-private exposures, ledger charge, nothing released, one table)."""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("peft")

from privtune.audit import AuditSpec, audit  # noqa: E402
from privtune.audit.exposure import (CANARY_PROMPT, NOT_PRIVATE_REFERENCE, DigitCanaries,  # noqa: E402
                                     exposure_estimates, make_digit_secrets, secret_losses)
from privtune.cli import main  # noqa: E402
from privtune.errors import DataError, InvalidParameterError, ModelError, UnknownDatasetError  # noqa: E402
from privtune.ledger import Ledger  # noqa: E402
from privtune.models.generator import Generator  # noqa: E402
from privtune.models.testing_causal_lm import make_tiny_causal_lm, make_tiny_tokenizer  # noqa: E402

PAIRS = [("hello how are you ?", "i am fine thanks ."), ("what do you like to eat ?", "italian food !"),
         ("are you good ?", "yes , thanks"), ("hello", "hello how are you ?")]


# ------------------------------------------------------------------ the estimator on given log-perplexities

def test_exact_rank_gives_log2_space_for_the_lowest_and_zero_for_ties_or_the_highest():
    cand = np.arange(1000, dtype=float) + 10.0  # the whole space, all distinct
    est = exposure_estimates([10.0, 1009.0, 509.0], cand, 1000, exact=True)
    assert est[0]["exposure"] == pytest.approx(math.log2(1000)) and est[0]["rank"] == 1
    assert est[1]["exposure"] == pytest.approx(0.0)
    assert est[2]["exposure"] == pytest.approx(math.log2(1000) - math.log2(500))
    flat = exposure_estimates([5.0], np.full(1000, 5.0), 1000, exact=True)  # every secret ties: no evidence
    assert flat[0]["exposure"] == pytest.approx(0.0)


def test_sampled_rank_and_skew_normal_extrapolation():
    rng = np.random.default_rng(0)
    cand = rng.normal(50.0, 3.0, size=2000)
    space = 10 ** 6
    mid = exposure_estimates([50.0], cand, space, exact=False)[0]  # about half the secrets are below: ≈ 1 bit
    assert mid["method"] == "sampled" and mid["exposure"] == pytest.approx(1.0, abs=0.15)
    far = exposure_estimates([50.0 - 6 * 3.0], cand, space, exact=False)[0]  # 6 σ below: beyond the sample
    assert far["method"] == "skew-normal fit" and math.log2(2000) < far["exposure"] <= math.log2(space)
    # 6 σ below a normal: p ≈ 1e-9, so the rank is 1 + (10^6 − 1)·p ≈ 1: exposure ≈ log2 |R|
    assert far["exposure"] == pytest.approx(math.log2(space), abs=0.1)
    with pytest.raises(InvalidParameterError):
        exposure_estimates([1.0], [1.0, 2.0], 1000, exact=True)  # an exact rank needs the whole space


# ------------------------------------------------------------------ toy models with a known answer

class _Bigram(nn.Module):
    """logits of the next token = table[current token]: a model whose preferences are set by hand."""

    def __init__(self, vocab: int):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(vocab, vocab))

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=self.table[input_ids])


def _toy(chain: list[str] | None = None, *, random_seed: int | None = None) -> Generator:
    """A bigram generator: uniform, random (``random_seed``), or forced to spell ``chain`` after the prompt."""
    tok = make_tiny_tokenizer()
    bigram = _Bigram(len(tok))
    with torch.no_grad():
        if random_seed is not None:
            bigram.table.copy_(torch.randn(bigram.table.shape, generator=torch.Generator().manual_seed(random_seed)))
        if chain is not None:
            ids = [tok.convert_tokens_to_ids(t) for t in ["is", *chain]] + [tok.eos_token_id]
            for a, b in zip(ids, ids[1:]):
                bigram.table[a, b] = 20.0
    return Generator(bigram, tok, max_length=32)


def _canaries(secrets, digits, candidates=2000):
    return DigitCanaries(secrets=list(secrets), included=[True] * len(secrets), user=None, union=None, digits=digits,
                         candidates=candidates, sample_seed=0)


def test_secret_losses_are_the_response_log_perplexity_in_bits():
    model = _toy(["1", "5", "8"])
    bits = secret_losses(model, ["1 5 8", "2 5 8"])
    tok = model.tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t in ["is", "1", "5", "8"]] + [tok.eos_token_id]
    logp = torch.log_softmax(model.backbone.table.detach(), dim=-1)
    expected = -sum(float(logp[a, b]) for a, b in zip(ids, ids[1:])) / math.log(2)
    assert bits[0] == pytest.approx(expected, rel=1e-6) and bits[1] > bits[0] + 20


def test_forced_canary_has_maximal_exposure_exactly():
    got = _canaries(["1 5 8", "2 4 6"], 3).measure(_toy(["1", "5", "8"]))
    e = got["exposure"]
    assert got["candidates_scored"] == 1000 and e[0]["method"] == "exact"
    assert e[0]["exposure"] == pytest.approx(math.log2(1000)) and e[0]["rank"] == 1
    assert e[1]["exposure"] < 3.0  # not the forced one
    assert got["scores"][0] > got["scores"][1]  # the one-run bound's score: minus the log-perplexity


def test_uniform_and_random_models_give_small_exposure():
    secrets = make_digit_secrets(30, 3, random.Random(1))
    flat = _canaries(secrets, 3).measure(_toy())
    assert all(e["exposure"] == pytest.approx(0.0) for e in flat["exposure"])  # every secret ties
    rand = _canaries(secrets, 3).measure(_toy(random_seed=0))
    xs = [e["exposure"] for e in rand["exposure"]]
    # a random model ranks a random secret uniformly: exposure about log2 e ≈ 1.44 bits on average
    assert 0.5 < np.mean(xs) < 2.5 and np.median(xs) < 2.0


def test_forced_canary_in_a_large_space_is_extrapolated_beyond_the_sample():
    got = _canaries(["1 5 8 2 7 3", "2 4 6 0 9 9"], 6, candidates=500).measure(_toy(["1", "5", "8", "2", "7", "3"]))
    forced, other = got["exposure"]
    assert got["candidates_scored"] == 500 and forced["method"] == "skew-normal fit"
    assert math.log2(500) < forced["exposure"] <= math.log2(10 ** 6) and other["exposure"] < 5.0


# ------------------------------------------------------------------ privtune audit on a tiny random LLaMA

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("memo")
    make_tiny_causal_lm(d / "llama", arch="llama", hidden_size=32)
    rows = [{"prompt": f"{PAIRS[i % 4][0]} riverside", "response": PAIRS[i % 4][1]} for i in range(40)]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return {"train": str(d / "train.jsonl"), "model": str(d / "llama")}


ARGS = dict(mode="full", epsilon=8.0, delta=1e-3, epochs=10.0, batch_size=20, learning_rate=1e-2, num_canaries=20,
            canary_digits=3, seed=0)


def _audit(data, *, spec: dict, **inputs):
    """audit(data, AuditSpec.create(**spec), ...) with the test's defaults."""
    return audit(data, AuditSpec.create(**{**ARGS, **spec}), progress=False, **inputs)


def test_audit_reports_exposures_beside_the_one_run_bound_and_releases_nothing(files, tmp_path):
    out = tmp_path / "a"
    rep = _audit(files["train"], spec=dict(public_data=True), model=files["model"], output_dir=out)
    mem = rep.memorisation
    assert rep.blackbox.num_canaries == 20 and rep.blackbox.epsilon_lower_bound <= 8.0
    assert len(mem.dp) == len(mem.reference) == 20 and mem.space_size == 1000
    assert rep.blackbox.scores == pytest.approx([-e["log_perplexity"] for e in mem.dp])
    inserted = [r["exposure"] for r, i in zip(mem.reference, mem.included) if i]
    left_out = [r["exposure"] for r, i in zip(mem.reference, mem.included) if not i]
    assert np.mean(inserted) > np.mean(left_out) + 1.0  # the non-private reference memorises its canaries
    saved = json.loads((out / "memorisation" / "exposure.json").read_text())
    assert saved["reference_label"] == NOT_PRIVATE_REFERENCE and saved["reference_label"].startswith("NOT PRIVATE")
    assert saved["secrets"] == mem.secrets and saved["prompt"] == CANARY_PROMPT
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert written == ["blackbox/audit.html", "blackbox/audit.json", "blackbox/audit.png", "memorisation/exposure.json",
                       "whitebox/audit.html", "whitebox/audit.json", "whitebox/audit.png"]  # no model, no data
    assert "riverside" not in json.dumps(saved) + (out / "blackbox" / "audit.json").read_text()


def test_private_audit_charges_the_dp_run_only(files, tmp_path):
    url = f"sqlite:///{tmp_path / 'l.db'}"
    with pytest.raises(UnknownDatasetError):
        _audit(files["train"], spec=dict(whitebox=False), model=files["model"], ledger=url)
    led = Ledger(url)
    led.init_dataset(files["train"], 20.0, 1e-3)
    rep = _audit(files["train"], spec=dict(whitebox=False, reference=False), model=files["model"], ledger=url)
    spent = 20.0 - Ledger(url).status(files["train"]).remaining_epsilon
    assert spent == pytest.approx(rep.blackbox.claimed_epsilon, rel=0.05)
    assert rep.memorisation.reference is None and "charged to the ledger" in rep.memorisation.privacy
    assert "non-private*" not in rep.summary() and "NOT PRIVATE: the non-private" not in rep.summary()


@pytest.mark.parametrize("spec, inputs, error, match", [
    (dict(mode="bitfit"), {}, ModelError, "has none"),
    (dict(mode="last-layer"), {}, InvalidParameterError, "mode"),
    (dict(canary_digits=6), dict(max_length=10), InvalidParameterError, "cuts the audit's canaries"),
    (dict(privacy_unit="speaker"), {}, DataError, "privacy-unit column 'speaker'"),
])
def test_refusals_come_before_any_charge_or_output(files, tmp_path, spec, inputs, error, match):
    url = f"sqlite:///{tmp_path / 'l.db'}"
    Ledger(url).init_dataset(files["train"], 20.0, 1e-3)
    with pytest.raises(error, match=match):
        _audit(files["train"], spec=spec, model=files["model"], ledger=url, output_dir=tmp_path / "o", **inputs)
    assert Ledger(url).status(files["train"]).remaining_epsilon == pytest.approx(20.0)
    assert not (tmp_path / "o").exists()


def test_user_level_audit_inserts_canary_units_and_trains_on_units(files, tmp_path, monkeypatch):
    """--privacy-unit on prompt → response data: each included canary is r rows of its secret, the run samples
    units (the user's senders and the canary units), and the report says so."""
    import privtune.training as training

    rows = [json.loads(line) for line in open(files["train"], encoding="utf-8")]
    data = tmp_path / "senders.jsonl"
    data.write_text("".join(json.dumps({**r, "sender": f"s{i % 8}"}) + "\n" for i, r in enumerate(rows)))
    seen = {}
    real_train = training.train

    def spy(union, **kw):
        seen.update(rows=len(union), units=list(kw.get("privacy_unit") or []), k=kw.get("max_rows_per_unit"),
                    secrets=[r for p, r in zip(union.prompts, union.responses) if p == CANARY_PROMPT])
        return real_train(union, **kw)

    monkeypatch.setattr(training, "train", spy)
    rep = _audit(str(data), spec=dict(public_data=True, whitebox=False, reference=False, privacy_unit="sender",
                                      max_rows_per_unit=3, canary_rows=3, batch_size=4), model=files["model"])
    included = rep.memorisation.included
    assert seen["rows"] == 40 + 3 * sum(included) and seen["k"] == 3
    assert len(set(seen["units"])) == 8 + sum(included)  # 8 senders and one unit per included canary
    ins = [s for s, i in zip(rep.memorisation.secrets, included) if i]
    assert seen["secrets"] == [s for s in ins for _ in range(3)]  # each secret three times, in its unit
    assert rep.blackbox.config["privacy_unit"] == "sender" and rep.blackbox.config["canary_rows"] == 3
    assert rep.memorisation.privacy_unit == {"unit": "sender", "max_rows_per_unit": 3, "canary_rows": 3}
    assert "each canary is a unit of 3 rows" in rep.memorisation.summary()
    assert rep.blackbox.epsilon_lower_bound <= rep.blackbox.claimed_epsilon


def test_cli_prints_one_exposure_table(files, tmp_path, capsys):
    rc = main(["audit", "--data", files["train"], "--model", files["model"], "--mode", "full", "--epsilon", "8",
               "--delta", "1e-3", "--epochs", "10", "--batch-size", "20", "--learning-rate", "0.01", "--canaries", "20",
               "--canary-digits", "3", "--public-data", "--seed", "0", "--quiet", "--output", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert rc == 0
    table = out[out.index("memorisation (exposure"):]
    lines = table.splitlines()
    assert lines[1].split() == ["canary", "inserted", "exposure", "DP", "non-private*", "how", "(DP)"]
    assert all(len(line.split()) == 7 and line.split()[3] == "yes" for line in lines[2:2 + 5])  # d d d yes DP ref how
    assert sum(line.startswith(("mean (", "max (")) for line in lines) == 4
    assert "* NOT PRIVATE" in table and "audit (black-box)" in out and "memorisation/exposure.json" in out


def test_cli_refuses_a_max_length_that_cuts_the_canaries_in_one_line(files, tmp_path, capsys):
    rc = main(["audit", "--data", files["train"], "--model", files["model"], "--epsilon", "8", "--delta", "1e-3",
               "--max-length", "10", "--public-data", "--quiet", "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error:") and "--max-length" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("kw, match", [
    (dict(canary_digits=1), "too few"),  # 10 secrets for the default 100 canaries
    (dict(canary_digits=3, num_canaries=600), "too few"),
    (dict(canary_digits=13), "canary_digits"),
    (dict(candidates=10), "candidates"),
    (dict(reference="no"), "reference"),
])
def test_the_secret_canaries_are_checked_when_the_spec_is_built(kw, match):
    with pytest.raises(InvalidParameterError, match=match):
        AuditSpec.create(epsilon=8.0, **kw)


def test_the_data_kind_fills_in_mode_and_canaries():
    spec = AuditSpec.create(epsilon=8.0, canary_digits=4, candidates=500, reference=False)
    assert (spec.mode, spec.num_canaries) == (None, None)
    assert (spec.exposure.canary_digits, spec.exposure.candidates, spec.exposure.reference) == (4, 500, False)
    lm, clf = spec.for_data(generation=True), spec.for_data(generation=False)
    assert (lm.mode, lm.num_canaries, clf.mode, clf.num_canaries) == ("lora", 100, "bitfit", 1000)
    assert AuditSpec.create(epsilon=8.0, mode="full", num_canaries=20).for_data(True).mode == "full"
