"""The generation task end to end on tiny random causal LMs: response-only loss through the task seam, the
bitfit refusal, ``privtune train``/``tune``/``predict`` on prompt → response JSONL, generations in the release
for public prompts only, and the embedded chitchat demo."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("sacrebleu")
pytest.importorskip("rouge_score")

from privtune.cli import main as cli_main  # noqa: E402
from privtune.data.generation import (EMBEDDED_CHITCHAT, GenerationDataset, embedded_chitchat,  # noqa: E402
                                      is_generation_data, names_causal_lm)
from privtune.errors import ModelError  # noqa: E402
from privtune.models.generator import apply_generation_mode, generation_modes, load_generator  # noqa: E402
from privtune.models.testing_causal_lm import make_tiny_causal_lm  # noqa: E402
from privtune.tasks import task_for  # noqa: E402
from privtune.tasks.generation import Generation  # noqa: E402

PAIRS = [("hello how are you ?", "i am fine thanks ."), ("what do you like to eat ?", "italian food !"),
         ("are you good ?", "yes , thanks"), ("hello", "hello how are you ?")]
#: a prompt word that only private rows contain (it must never reach a shareable file)
PRIVATE_MARK = "riverside"


class _Result:
    def __init__(self, exit_code: int, output: str):
        self.exit_code, self.output = exit_code, output


@pytest.fixture
def cli(capsys):
    """Run ``privtune ARGS`` in this process: exit status and stdout + stderr."""
    def run(args):
        capsys.readouterr()
        code = cli_main([str(a) for a in args])
        got = capsys.readouterr()
        return _Result(code, got.out + got.err)
    return run


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen")
    make_tiny_causal_lm(d / "llama", arch="llama")
    make_tiny_causal_lm(d / "gpt2", arch="gpt2")
    train = [{"prompt": f"{PAIRS[i % 4][0]} {PRIVATE_MARK} {i % 5}", "response": PAIRS[i % 4][1]} for i in range(40)]
    public = [{"prompt": f"{p} the", "response": r} for p, r in PAIRS]
    test = [{"prompt": f"{p} a", "response": r} for p, r in PAIRS]
    return {"dir": d, "train": _write(d / "train.jsonl", train), "public": _write(d / "public.jsonl", public),
            "test": _write(d / "test.jsonl", test), "llama": d / "llama", "gpt2": d / "gpt2"}


def test_detection_and_task_registry(files, tmp_path):
    assert is_generation_data(files["train"]) and is_generation_data(EMBEDDED_CHITCHAT)
    (tmp_path / "cls.tsv").write_text("text\tlabel\nhello\t1\n")
    assert not is_generation_data(tmp_path / "cls.tsv")
    assert task_for(GenerationDataset(prompts=["a"], responses=["b"])).name == "text-generation"


def test_a_causal_lm_reads_columns_the_user_names(cli, files, tmp_path):
    """A file whose columns are not among the detected names is prompt → response data when the model is a causal
    LM (a known name or a directory whose config lists a ...ForCausalLM / ...LMHeadModel architecture) and the file
    has no classifier label column; `--text-column`/`--label-column` name the prompt and the response."""
    qa = _write(tmp_path / "qa.jsonl", [{"question": p, "answer": r} for p, r in PAIRS * 5])
    (tmp_path / "cls.tsv").write_text("text\tlabel\nhello\t1\n")
    (tmp_path / "encoder").mkdir()
    (tmp_path / "encoder" / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    assert not is_generation_data(qa)  # no model: the columns decide, and these are not a prompt and a response
    assert is_generation_data(qa, files["llama"]) and is_generation_data(qa, str(files["gpt2"]))
    assert names_causal_lm("smollm2-135m") and names_causal_lm("SmolLM2-135M ")
    assert not is_generation_data(qa, tmp_path / "encoder") and not is_generation_data(qa, None)
    assert not is_generation_data(tmp_path / "cls.tsv", files["llama"])  # a label column: a classifier's data
    out = tmp_path / "run"
    r = cli(["train", "--data", qa, "--model", files["llama"], "--text-column", "question", "--label-column", "answer",
             "--epsilon", "8", "--epochs", "1", "--batch-size", "10", "--ledger", f"sqlite:///{tmp_path / 'l.db'}",
             "--output", out, "--quiet"])
    assert r.exit_code == 0, r.output
    assert "on eval data: n/a (no --eval-data)" in r.output and "accuracy" not in r.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["task"] == "text-generation" and metrics["perplexity"] is None
    assert (out / "model" / "privtune_generator.json").is_file()
    assert "evaluation split" not in (out / "model" / "README.md").read_text()  # none was given
    report = (out / "report.html").read_text()
    assert "No evaluation split was given" in report and "reported scores was never used" not in report
    # without the names, the refusal says which flag names the prompt column
    r = cli(["train", "--data", qa, "--model", files["llama"], "--epsilon", "8", "--ledger",
             f"sqlite:///{tmp_path / 'l2.db'}", "--output", tmp_path / "run2", "--quiet"])
    assert r.exit_code != 0 and "no prompt column" in r.output and "--text-column" in r.output
    assert "Traceback" not in r.output and not (tmp_path / "run2" / "certificate.json").exists()


def test_loss_is_response_only_and_summed(files):
    """The task's per-example loss: changing a prompt token's label cannot matter (it is -100), the loss is the
    sum over response tokens, and row i's loss depends on row i only."""
    model = load_generator(str(files["llama"]), max_length=32)
    task = Generation()
    ds = GenerationDataset(prompts=[p for p, _ in PAIRS], responses=[r for _, r in PAIRS])
    batch = task.batch(model, ds, torch.arange(4))
    labels = batch["labels"]
    tok = model.tokenized(ds)
    for i in range(4):
        n_prompt, n = tok.prompt_lengths[i], len(tok.input_ids[i])
        assert (labels[i, :n_prompt] == -100).all() and (labels[i, n_prompt:n] != -100).all()
        assert (labels[i, n:] == -100).all()  # padding
    with torch.no_grad():
        losses = task.per_example_loss(model, batch)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        logp = logits.log_softmax(-1)
        for i in range(4):
            ref = -sum(float(logp[i, t - 1, labels[i, t]]) for t in range(1, labels.shape[1]) if labels[i, t] != -100)
            assert math.isclose(float(losses[i]), ref, rel_tol=1e-5)
        alone = task.per_example_loss(model, {k: v[2:3] for k, v in batch.items()})
    assert torch.allclose(alone, losses[2:3], rtol=1e-5)


def test_bitfit_refused_for_llama_and_applies_to_gpt2(files):
    llama = load_generator(str(files["llama"]))
    assert generation_modes(llama) == ["lora", "full"]
    with pytest.raises(ModelError, match="bitfit.*no biases|has none"):
        apply_generation_mode(llama, "bitfit")
    gpt2 = load_generator(str(files["gpt2"]))
    assert generation_modes(gpt2) == ["lora", "full", "bitfit"]
    info = apply_generation_mode(gpt2, "bitfit")
    assert info.trainable and all(n.endswith("bias") for n in info.trainable)


def test_train_cli_refuses_bitfit_on_llama_before_any_charge(cli, files, tmp_path):
    led = tmp_path / "ledger.db"
    r = cli(["train", "--data", str(files["train"]), "--model", str(files["llama"]), "--mode",
                                  "bitfit", "--epsilon", "8", "--ledger", f"sqlite:///{led}", "--output",
                                  str(tmp_path / "run"), "--quiet"])
    assert r.exit_code != 0 and "no biases" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "run" / "certificate.json").exists()
    assert not led.exists() or "ds-" not in cli(["budget", "show", "--ledger",
                                                                       f"sqlite:///{led}"]).output


def test_train_lora_default_end_to_end(cli, files, tmp_path):
    out = tmp_path / "run"
    r = cli(["train", "--data", str(files["train"]), "--eval-data", str(files["test"]), "--model",
                                  str(files["llama"]), "--epsilon", "8", "--epochs", "1", "--batch-size", "10",
                                  "--ledger", f"sqlite:///{tmp_path / 'l.db'}", "--output", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    assert "trained lora" in r.output and "perplexity" in r.output
    m = json.loads((out / "metrics.json").read_text())
    assert m["task"] == "text-generation" and m["mode"] == "lora" and m["perplexity"] > 1
    assert {"bleu", "chrf", "rouge_l"} <= set(m)
    card = (out / "model" / "README.md").read_text()
    assert "pipeline_tag: text-generation" in card
    assert (out / "model" / "privtune_generator.json").is_file()
    report = (out / "report.html").read_text()
    assert "reported scores was never used to select" in report and "No evaluation split" not in report
    # the released model is a plain Hugging Face causal LM (LoRA merged)
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(out / "model")
    assert not any("lora_" in n for n, _ in lm.named_parameters())


def _tune(cli, files, tmp_path, *extra):
    out = tmp_path / "tune"
    args = ["tune", "--data", str(files["train"]), "--eval-data", str(files["test"]), "--public-eval-data",
            str(files["public"]), "--model", str(files["gpt2"]), "--epsilon", "8", "--epochs", "1", "--batch-size",
            "20", "--ledger", f"sqlite:///{tmp_path / 'l.db'}", "--output", str(out), "--quiet", *extra]
    r = cli(args)
    assert r.exit_code == 0, r.output
    return out, r.output


def test_tune_auto_charges_every_trial_and_shows_public_generations_only(cli, files, tmp_path):
    out, output = _tune(cli, files, tmp_path)
    m = json.loads((out / "metrics.json").read_text())
    cert = json.loads((out / "certificate.json").read_text())
    assert m["strategy"] == "lr-sweep" and m["trials"] == 3  # auto on GPT-2: lora, full, bitfit
    assert len(cert["events"]) == 3 and cert["epsilon"] <= 8 * (1 + 1e-6)
    assert m["selection"].startswith("public-validation")
    hist = json.loads((out / "history.json").read_text())
    assert sorted(t["mode"] for t in hist["trials"]) == ["bitfit", "full", "lora"]
    chosen = min(hist["trials"], key=lambda t: t["public_perplexity"])
    assert m["mode"] == chosen["mode"]
    samples = m["public_generations"]["samples"]
    public_prompts = {json.loads(line)["prompt"] for line in files["public"].read_text().splitlines()}
    assert samples and all(s["prompt"] in public_prompts for s in samples)
    # no private prompt (nor its marker word) in any shareable file of the release
    for name in ("metrics.json", "history.json", "report.html", "certificate.json", "config.yaml", "log.txt",
                 "model/README.md"):
        assert PRIVATE_MARK not in (out / name).read_text(encoding="utf-8"), name
    html = (out / "report.html").read_text(encoding="utf-8")
    assert "Generations for public prompts" in html and samples[0]["prompt"].split()[0] in html
    assert "all 3 trial(s) charged" in output


def test_a_public_split_warm_starts_every_trial_and_selects_with_its_other_half(cli, files, tmp_path, monkeypatch):
    """A public split of at least WARM_START_MIN_PUBLIC pairs is cut in two: one half fine-tunes the model without
    noise (public data: nothing charged), every trial starts from those weights, the other half selects."""
    import privtune.models.generator as generator
    import privtune.training as training
    from privtune.hpo.generation_tune import WARM_START_MIN_PUBLIC

    public = _write(tmp_path / "public24.jsonl", [{"prompt": f"{p} the {i}", "response": r}
                                                  for i in range(6) for p, r in PAIRS])
    assert 24 >= WARM_START_MIN_PUBLIC
    warm_rows, starts = [], []
    real_fit, real_apply = training.fit_nonprivate, generator.apply_generation_mode

    def fit_spy(model, data, **kw):
        warm_rows.append(list(data.prompts))
        return real_fit(model, data, **kw)

    def apply_spy(model, mode, **kw):  # the weights each model starts from, before its mode is applied
        starts.append({k: v.detach().clone() for k, v in model.backbone.state_dict().items()})
        return real_apply(model, mode, **kw)

    monkeypatch.setattr(training, "fit_nonprivate", fit_spy)
    monkeypatch.setattr(generator, "apply_generation_mode", apply_spy)
    out = tmp_path / "warm"
    r = cli(["tune", "--data", str(files["train"]), "--public-eval-data", str(public), "--model", str(files["llama"]),
             "--mode", "lora", "--epsilon", "8", "--epochs", "1", "--batch-size", "20", "--ledger",
             f"sqlite:///{tmp_path / 'l.db'}", "--output", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    public_prompts = {json.loads(line)["prompt"] for line in public.read_text().splitlines()}
    assert len(warm_rows) == 1 and len(warm_rows[0]) == 12 and set(warm_rows[0]) <= public_prompts  # public only
    m = json.loads((out / "metrics.json").read_text())
    assert m["hyperparameters"]["public_warm_start"]["pairs"] == 12
    assert m["selection"] == "public-validation: perplexity on 12 pairs of public24.jsonl (its other 12 pairs " \
                             "warm-start the model)"
    assert "public warm start" in (out / "log.txt").read_text()
    # starts: the load-time probe, the warm-start model (both from the pretrained weights), then the 3 trials
    assert len(starts) == 5
    pretrained, trials = starts[1], starts[2:]
    assert all(torch.equal(pretrained[k], starts[0][k]) for k in pretrained)
    for start in trials:  # every trial from the same warm-started weights, not the pretrained ones
        assert all(torch.equal(start[k], trials[0][k]) for k in start)
        assert any(not torch.equal(start[k], pretrained[k]) for k in start)
    cert = json.loads((out / "certificate.json").read_text())
    assert len(cert["events"]) == 3  # the warm start charges nothing


def test_tune_random_search_and_refusals(cli, files, tmp_path):
    out, _ = _tune(cli, files, tmp_path, "--strategy", "random-search", "--trials", "2", "--mode", "lora",
                   "--max-length", "24")
    m = json.loads((out / "metrics.json").read_text())
    assert m["strategy"] == "random-search" and m["trials"] == 2 and m["mode"] == "lora"
    assert m["hyperparameters"]["max_length"] == 24  # the public token length reaches every trial's generator
    r = cli(["tune", "--data", str(files["train"]), "--model", str(files["gpt2"]), "--public-eval-data",
             str(files["public"]), "--max-length", "1", "--output", str(tmp_path / "z"), "--ledger",
             f"sqlite:///{tmp_path / 'l3.db'}", "--quiet"])
    assert r.exit_code != 0 and "max_length" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "l3.db").exists()
    r = cli(["tune", "--data", str(files["train"]), "--model", str(files["gpt2"]), "--output",
                                  str(tmp_path / "x"), "--ledger", f"sqlite:///{tmp_path / 'l2.db'}", "--quiet"])
    assert r.exit_code != 0 and "--public-eval-data" in r.output and "Traceback" not in r.output
    r = cli(["tune", "--data", str(files["train"]), "--model", str(files["gpt2"]),
                                  "--strategy", "linear-scaling", "--output", str(tmp_path / "y"), "--quiet"])
    assert r.exit_code != 0 and "not available for prompt" in r.output


def test_tune_refuses_options_that_do_not_apply_to_a_generator(files, tmp_path):
    """Options of image or classifier tuning are one clear error on prompt → response data, before anything is
    read or charged (the typed arguments are checked, not a dict of locals)."""
    import privtune
    from privtune.errors import InvalidParameterError

    for option in ({"image_size": 64}, {"time_budget": 5.0}, {"selection": "train-accuracy"}, {"labels": [0, 1]}):
        ledger = tmp_path / f"{next(iter(option))}.db"
        with pytest.raises(InvalidParameterError, match=f"`{next(iter(option))}` does not apply"):
            privtune.tune(str(files["train"]), model=str(files["gpt2"]), ledger=f"sqlite:///{ledger}",
                          output_dir=tmp_path / next(iter(option)), quiet=True, **option)
        assert not ledger.exists() and not (tmp_path / next(iter(option))).exists()


def test_predict_generates_greedy_and_beam_and_refuses_bad_input(cli, files, tmp_path):
    out, _ = _tune(cli, files, tmp_path, "--trials", "1", "--mode", "full")
    prompts = _write(tmp_path / "prompts.jsonl", [{"prompt": "hello how are you ?"}, {"prompt": "are you good ?"}])
    r = cli(["predict", "--model", str(out), "--data", str(prompts), "--json", "--max-new-tokens", "3"])
    assert r.exit_code == 0, r.output
    obj = json.loads(r.output)
    assert obj["n"] == 2 and len(obj["generations"]) == 2 and obj["decoding"] == "greedy"
    assert all(len(g.split()) <= 3 for g in obj["generations"])
    r = cli(["predict", "--model", str(out / "model"), "--data", str(files["test"]), "--num-beams",
                             "2", "--max-new-tokens", "4"])
    assert r.exit_code == 0 and "BLEU" in r.output
    bad = _write(tmp_path / "bad.jsonl", [{"foo": "x"}])
    r = cli(["predict", "--model", str(out), "--data", str(bad)])
    assert r.exit_code != 0 and "no prompt column" in r.output and "Traceback" not in r.output
    r = cli(["predict", "--model", str(out), "--data", str(prompts), "--num-beams", "0"])
    assert r.exit_code != 0 and "num_beams" in r.output


def test_embedded_chitchat_split_by_conversation():
    train, public, test = embedded_chitchat()
    assert (len(train), len(public), len(test)) == (800, 200, 200)
    convs = []
    for ds in (train, public, test):
        rows = [json.loads(line) for line in open(ds.source, encoding="utf-8")]
        convs.append({r["conversation"] for r in rows})
        assert all(len(r["context"]) <= 160 and len(r["response"]) <= 120 for r in rows)
    assert not (convs[0] & convs[1]) and not (convs[0] & convs[2]) and not (convs[1] & convs[2])
    import os

    assert sum(os.path.getsize(ds.source) for ds in (train, public, test)) < 1_000_000


def test_embedded_chitchat_tune_with_a_tiny_model(cli, files, tmp_path):
    """One command on the demo data (the tiny model stands in for SmolLM2): ledger in the run directory, the
    public split selects and its prompts are the ones shown."""
    out = tmp_path / "demo"
    r = cli(["tune", "--data", EMBEDDED_CHITCHAT, "--model", str(files["llama"]), "--epsilon",
                                  "8", "--epochs", "0.1", "--batch-size", "40", "--mode", "lora", "--trials", "2",
                                  "--output", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    m = json.loads((out / "metrics.json").read_text())
    assert m["reported_split"] == "chitchat_test.jsonl" and m["public_generations"]["split"] == "chitchat_public.jsonl"
    assert (out / "ledger.db").exists()
    train_prompts = set(embedded_chitchat()[0].prompts)
    assert not any(s["prompt"] in train_prompts for s in m["public_generations"]["samples"])
    assert "chitchat" in (out / "model" / "README.md").read_text()
