"""``privtune train`` and ``privtune predict``: thin click edges over :func:`privtune.training.train`
and :meth:`privtune.models.Classifier.predict_logits`.

::

    privtune train --data FILE [--labels neg,pos] [--eval-data FILE] [--model PATH]
                   --mode {full,bitfit,last-layer,lora,two-phase}
                   (--epsilon E --delta D | --noise-multiplier S) [--epochs N | --steps N] [--batch-size B]
                   [--learning-rate LR] [--clip C] [--optimizer {sgd,adam,adamw,lamb}] [--ledger URL]
                   [--config FILE] [--resume] --output RUN_DIR
    privtune predict --model RUN_DIR/model --data FILE [--json] [--max-new-tokens N] [--num-beams K]
"""

from __future__ import annotations

import json

import click

# The choices and defaults shown here come from privtune.choices, which imports nothing, so that `privtune train
# --help`, `privtune predict --help` and a usage error do not import torch; tests/test_choices.py checks them
# against train()'s own
from privtune.choices import (ACCOUNTANTS, CLIPPINGS, OPTIMIZERS, POOLING_CHOICES, SAMPLING_SCHEMES,
                              TRAIN_DEFAULTS as _TRAIN_DEFAULTS, TRAIN_MODES as MODES)
from privtune.cli.config_file import explicit_cli_values, resolve_options
from privtune.cli.notices import registration_notice
from privtune.cli.options import data_options, model_options


@click.command("train", context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--data", type=str, help="Training data: .tsv/.csv/.jsonl (text + label columns, or prompt + response "
              "columns to fine-tune a causal language model), an image folder, or embedded:chitchat (the generation "
              "demo).")
@click.option("--eval-data", type=str, help="Evaluation split (accuracy reported on it).")
@click.option("--model", type=str, help="Backbone directory (Hugging Face format). Default: bundled all-MiniLM-L6-v2.")
@model_options()
@click.option("--mode", type=click.Choice(MODES), help="What is trained.  [required; on prompt → response pairs "
              "lora by default, also full, or bitfit where the model has biases]")
@click.option("--epsilon", type=float, help="Target ε of this run (with --delta).")
@click.option("--delta", type=float, help="δ (default: min(1e-5, <1/(10·N))).")
@click.option("--noise-multiplier", type=float, help="σ instead of --epsilon (ε is then reported).")
@click.option("--epochs", type=float, help="Passes over the data (default 3).")
@click.option("--steps", type=int, help="Optimizer steps (instead of --epochs).")
@click.option("--batch-size", type=int, help="Expected Poisson batch size B (default min(N, 256)).")
@click.option("--learning-rate", type=float, help="Learning rate (default by mode).")
@click.option("--backbone-lr-scale", type=float,
              help="α in (0, 1]: the head trains at --learning-rate, every other trainable parameter at α times it "
                   "(Mehta et al.'s pre-trained-layer multiplier, large-scale transfer; default 0.1 for --mode full, "
                   "else 1: one rate).")
@click.option("--privacy-unit", type=str,
              help="User-level DP: the column naming the person (document, conversation) owning each row. The "
                   "guarantee is then for adding or removing all rows of one unit; --batch-size counts units and "
                   "--delta must be below 1/(number of units). See docs/privacy-unit.md.")
@click.option("--max-rows-per-unit", type=int,
              help=f"With --privacy-unit: the public cap k on one unit's rows per step "
                   f"(default {_TRAIN_DEFAULTS['max_rows_per_unit']}).")
@click.option("--clip", type=float, help=f"Per-example clipping norm C (default {_TRAIN_DEFAULTS['clip']}).")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), help=f"Optimizer (default {_TRAIN_DEFAULTS['optimizer']}).")
@click.option("--ledger", type=str, help="Budget ledger URL (default $PRIVTUNE_LEDGER or ~/.privtune/ledger.db).")
@click.option("--config", type=str, help="YAML configuration file (flags override it).")
@click.option("--resume", is_flag=True, default=None,
              help="Continue an interrupted run in --output exactly (also one interrupted while writing its files): "
                   "no new charge. See docs/cli.md, 'After a crash'.")
@click.option("--output", type=str, help="Run directory RUN_DIR.  [required]")
@click.option("--clipping", type=click.Choice(CLIPPINGS),
              help=f"flat (Abadi) or automatic (AUTO-S) (default {_TRAIN_DEFAULTS['clipping']}).")
@click.option("--per-layer-clipping", is_flag=True, default=None,
              help="Clip each layer to C/sqrt(K) instead of the whole gradient to C (same σ and ε).")
@click.option("--sampling", type=click.Choice(SAMPLING_SCHEMES),
              help=f"Batch sampling (default {_TRAIN_DEFAULTS['sampling']}).")
@click.option("--assume-poisson", is_flag=True, default=None,
              help="With --sampling shuffle only: account the shuffled batches AS IF Poisson sampled (an assumption, "
                   "not a proof; recorded in the certificate). Default: shuffling gets no amplification.")
@click.option("--lora-rank", type=int, help="--mode lora: LoRA rank r >= 1 (default 8).")
@click.option("--lora-alpha", type=float, help="--mode lora: LoRA scaling alpha, update = alpha/r * B A (default 16).")
@click.option("--lora-target-modules", type=str,
              help="--mode lora: comma-separated module names that get adapters, e.g. query,value "
                   "(default per architecture).")
@click.option("--device", type=str, help="cpu, cuda, cuda:N or mps (default: cuda when available, else cpu).")
@click.option("--accountant", type=click.Choice(ACCOUNTANTS),
              help=f"Privacy accountant (default {_TRAIN_DEFAULTS['accountant']}).")
@click.option("--max-physical-batch-size", type=int,
              help=f"Micro-batch size in memory (default {_TRAIN_DEFAULTS['max_physical_batch_size']}).")
@data_options()
@click.option("--seed", type=int, help="Seed for head init, sampling and noise (experiments; recorded).")
@click.option("--phase1-epochs", type=float, help="two-phase: epochs of DP full fine-tuning first (default 1).")
@click.option("--pooling", type=click.Choice(POOLING_CHOICES),
              help=f"Head pooling (default {_TRAIN_DEFAULTS['pooling']}: mean for sentence-transformers checkpoints, "
                   "else the model's head).")
@click.option("--max-length", type=int, help="Token truncation length (default 128).")
@click.option("--clipping-diagnostics", is_flag=True, default=None,
              help="Record clipping diagnostics (NOT PRIVATE: reads private data without noise).")
@click.option("--quiet", is_flag=True, default=None, help="No progress display (log.txt is still written).")
def train(**kwargs) -> None:
    """Fine-tune a model privately with fixed hyperparameters.

    Reserves the run's privacy cost in the ledger before training, and writes RUN_DIR/model
    (save_pretrained), certificate.json, metrics.json, history.json, config.yaml and log.txt.
    """
    ctx = click.get_current_context()
    opts = resolve_options("train", kwargs.get("config"), explicit_cli_values(ctx))
    from privtune.data.generation import is_generation_data

    generation = opts.get("data") not in (None, "") and is_generation_data(opts["data"], opts.get("model"))  # LoRA by default
    for key, flag in (("data", "--data"), ("mode", "--mode"), ("output", "--output")):
        if opts.get(key) in (None, "") and not (key == "mode" and generation):
            raise click.UsageError(f"Missing option '{flag}' (give it as a flag or in --config).")
    if opts.get("max_rows_per_unit") is not None and opts.get("privacy_unit") in (None, ""):
        raise click.UsageError("--max-rows-per-unit applies only with --privacy-unit COLUMN (user-level DP). Add "
                               "--privacy-unit, or drop --max-rows-per-unit.")
    # everything else (epsilon XOR noise_multiplier, epochs XOR steps, ranges) is checked once, by train()
    args = dict(
        data=opts["data"], eval_data=opts.get("eval_data"), model=opts.get("model"), mode=opts.get("mode"),
        epsilon=opts.get("epsilon"), delta=opts.get("delta"), noise_multiplier=opts.get("noise_multiplier"),
        epochs=opts.get("epochs"), steps=opts.get("steps"), batch_size=opts.get("batch_size"),
        learning_rate=opts.get("learning_rate"), ledger=opts.get("ledger"), output_dir=opts["output"],
        seed=opts.get("seed"), resume=bool(opts.get("resume")), progress=not opts.get("quiet"),
        text_column=opts.get("text_column"), label_column=opts.get("label_column"),
        clipping_diagnostics=bool(opts.get("clipping_diagnostics")),
    )
    for key in ("clip", "clipping", "per_layer_clipping", "optimizer", "sampling", "accountant", "backbone_lr_scale",
                "max_physical_batch_size",
                "phase1_epochs", "pooling", "max_length", "assume_poisson", "lora_rank", "lora_alpha",
                "lora_target_modules", "device", "labels", "privacy_unit", "max_rows_per_unit", "image_size",
                "batchnorm", "image_features"):
        if opts.get(key) is not None:
            args[key] = opts[key]
    from privtune.training import REGISTERED_NOTE, train as run_train  # torch: imported when a run starts

    result = run_train(**args)
    from privtune.engine.distributed import is_main_process

    if not is_main_process():  # torchrun: rank 0 reports the run (the other processes wrote nothing)
        return
    m = result.metrics
    if m.get("task") == "text-generation":
        scores = (f"perplexity {m['perplexity']:.2f}, BLEU {m['bleu']:.2f}, chrF {m['chrf']:.2f}, ROUGE-L "
                  f"{m['rouge_l']:.2f}" if m.get("perplexity") is not None else "n/a (no --eval-data)")
        shown = f"on {m.get('reported_split') or 'eval data'}: {scores}"
    else:
        acc = f"{m['accuracy']:.4f}" if m.get("accuracy") is not None else "n/a (no --eval-data)"
        shown = f"accuracy on {m.get('reported_split') or 'eval data'}: {acc}"
    click.echo(f"trained {m['mode']} for {m['steps']} steps: ε = {m['epsilon']:.4g}, δ = {m['delta']:.3g}; {shown}")
    registered = bool(m.get("ledger_registered_new_dataset"))
    if registered:
        status_total = m["epsilon"] if opts.get("epsilon") is None else opts["epsilon"]
        click.echo(registration_notice(str(opts["data"]), dataset_id=m.get("dataset_id"), total_epsilon=status_total,
                                       delta=m["delta"], ledger_url=m.get("ledger_url") if opts.get("ledger") else None))
    if m.get("ledger_remaining_epsilon") is not None:
        click.echo(f"ledger: remaining ε for this dataset = {m['ledger_remaining_epsilon']:.4g}")
    for note in result.certificate.metadata.get("notes", []):
        if not (registered and note.startswith(REGISTERED_NOTE)):  # said above, with the command that raises it
            click.echo(f"note: {note}")
    if m.get("seeded"):
        from privtune.report.release import seeded_notice

        click.echo(seeded_notice(True))
    click.echo(f"wrote {result.output_dir}")


@click.command("predict", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", "model_dir", required=True, type=str, help="A trained model: RUN_DIR/model (or RUN_DIR).")
@click.option("--data", required=True, type=str,
              help="A .tsv/.csv/.jsonl file to predict, or images: a folder of them (class sub-folders give the "
                   "accuracy), one image file or an IDX images file.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (key `accuracy` when labels are present).")
@data_options(labels_default=None, label_column_help="Label column name (auto-detected; optional).")
@click.option("--batch-size", type=int, default=64, show_default=True, help="Examples per forward pass.")
@click.option("--device", type=str, help="cpu, cuda, cuda:N or mps (default: cuda when available, else cpu).")
@click.option("--max-new-tokens", type=int, help="A generator: at most this many new tokens per prompt (default 32).")
@click.option("--num-beams", type=int, help="A generator: beam search with this many beams (default 1: greedy).")
def predict(model_dir: str, data: str, as_json: bool, text_column: str | None, label_column: str | None,
            batch_size: int, device: str | None, max_new_tokens: int | None, num_beams: int | None) -> None:
    """Predict with a fine-tuned model; print accuracy when the data has labels.

    The data may be unlabelled: a single text column (TSV/CSV/JSONL) is enough, and for an image model a
    folder of images without class sub-folders or one image file (each prediction names its file).  Labels, when present,
    must be in the model's label set (names as names, integer classes as integers); anything else is
    refused, never remapped.  A generator (a model trained on prompt → response pairs) generates a response
    for every prompt (greedy, or beam search with --num-beams), and prints BLEU, chrF and ROUGE-L when the data
    has responses.
    """
    from pathlib import Path

    from privtune._validation import check_int
    from privtune.data import load_dataset
    from privtune.models import Classifier, resolve_device
    from privtune.models.generator import is_generator_dir

    batch_size = check_int(batch_size, "batch_size", low=1)
    dev = resolve_device(device)
    d = Path(model_dir)
    if is_generator_dir(d / "model"):
        d = d / "model"
    if is_generator_dir(d):
        _predict_generation(d, data, as_json, text_column, label_column, batch_size, dev, max_new_tokens, num_beams)
        return
    if max_new_tokens is not None or num_beams is not None:
        from privtune.errors import InvalidParameterError

        raise InvalidParameterError("--max-new-tokens and --num-beams apply to a generator; this model is a "
                                    "classifier. Drop them.")
    if (d / "model" / "privtune_classifier.json").is_file():
        d = d / "model"
    model = Classifier.from_pretrained(d).to(dev)
    ds = load_dataset(data, text_column, label_column, label_names=model.label_names,
                      num_labels=model.num_labels, require_labels=False)
    if ds.kind != model.kind:
        from privtune.errors import DataError

        raise DataError(f"`data` is {ds.kind} but the model takes {model.kind} inputs.")
    logits = model.predict_logits(ds, batch_size=batch_size)
    probs = logits.softmax(1)
    pred = probs.argmax(1)
    names = model.label_names
    out_labels = [names[i] if names else int(i) for i in pred.tolist()]
    accuracy = None
    if ds.labels is not None:
        import torch

        accuracy = float((pred == torch.tensor(ds.labels)).float().mean())
    files = _image_files(ds)  # images: which file each prediction is for
    if as_json:
        obj = {"predictions": out_labels, "probabilities": [[round(x, 6) for x in row] for row in probs.tolist()],
               "n": len(ds)}
        if files is not None:
            obj["files"] = files
        if accuracy is not None:
            obj["accuracy"] = accuracy
        click.echo(json.dumps(obj))
        return
    click.echo("index\tprediction\tprobability" + ("\tfile" if files is not None else ""))
    for i, (lab, p) in enumerate(zip(out_labels, probs.max(1).values.tolist())):
        click.echo(f"{i}\t{lab}\t{p:.4f}" + (f"\t{files[i]}" if files is not None else ""))
    if accuracy is not None:
        click.echo(f"accuracy: {accuracy:.4f} ({len(ds)} examples)")


def _image_files(ds) -> list[str] | None:
    """The files of an image dataset read from disk, relative to the folder given (``None`` for other data)."""
    from pathlib import Path

    if getattr(ds, "kind", None) != "image" or not all(isinstance(im, str) for im in ds.images):
        return None
    root = Path(ds.source) if ds.source else None
    if root is not None and root.is_file():
        root = root.parent
    out = []
    for im in ds.images:
        path = Path(im).resolve()
        out.append(str(path.relative_to(root)) if root is not None and path.is_relative_to(root) else str(im))
    return out


def _predict_generation(d, data: str, as_json: bool, prompt_column: str | None, response_column: str | None,
                        batch_size: int, device, max_new_tokens: int | None, num_beams: int | None) -> None:
    """``privtune predict`` for a generator: one response per prompt; scores when the data has responses."""
    from privtune._validation import check_int
    from privtune.data.generation import load_generation_dataset
    from privtune.eval.generation import generation_scores
    from privtune.models.generator import load_generator

    max_new_tokens = check_int(32 if max_new_tokens is None else max_new_tokens, "max_new_tokens", low=1)
    num_beams = check_int(1 if num_beams is None else num_beams, "num_beams", low=1)
    ds = load_generation_dataset(data, prompt_column=prompt_column, response_column=response_column,
                                 require_responses=False)
    model = load_generator(str(d))
    model.to(device)
    outs = model.generate(ds.prompts, max_new_tokens=max_new_tokens, num_beams=num_beams, batch_size=batch_size)
    scores = generation_scores(outs, ds.responses) if ds.responses is not None else None
    if as_json:
        obj = {"generations": outs, "n": len(ds), "decoding": "greedy" if num_beams == 1 else f"beam search ({num_beams})",
               "max_new_tokens": max_new_tokens}
        if scores is not None:
            obj.update(scores)
        click.echo(json.dumps(obj, ensure_ascii=False))
        return
    click.echo("index\tgenerated")
    for i, text in enumerate(outs):
        click.echo(f"{i}\t{text}")
    if scores is not None:
        click.echo(f"BLEU {scores['bleu']:.2f}, chrF {scores['chrf']:.2f}, ROUGE-L {scores['rouge_l']:.2f} "
                   f"({len(ds)} examples)")
