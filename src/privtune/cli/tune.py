"""``privtune tune`` and ``privtune recommend``: thin click edges over :func:`privtune.hpo.tune`
and :func:`privtune.hpo.recommend`.

::

    privtune tune [--data FILE] [--labels neg,pos] [--text-column C] [--label-column C] [--eval-data FILE] [--model PATH] [--mode M|auto] [--strategy S] [--epsilon E]
                  [--delta D] [--ledger URL] [--config FILE] [--output RUN_DIR] [--device D] [--resume] [--quiet]
                  [--executor local|ray] [--ray-address auto|HOST:PORT|ray://HOST:PORT]
    privtune recommend --epsilon E --delta D --dataset-size N --epochs K [--json]

With no arguments ``privtune tune`` runs the embedded demo: the SST-2 subset shipped with
privtune, the bundled MiniLM, total ε = 1, δ = 1e-5, its ledger inside the run directory;
``privtune tune --data embedded:fashion-mnist`` runs the image demo the same way (3,000 Fashion-MNIST images,
ImageNet EfficientNet-Lite0) and ``privtune tune --data embedded:chitchat`` the generation demo (800 chitchat
context → response pairs, SmolLM2-135M with LoRA, selection by perplexity on 200 public pairs).
"""

from __future__ import annotations

import json
import os

import click

# The choices and the defaults shown here come from privtune.choices, which imports nothing, so that
# `privtune tune --help` does not import torch; tests/test_choices.py checks them against tune()'s own
# signature and the strategy registry.  A default is applied by tune() itself: the CLI passes only what
# the user set (flag or file).
from privtune.choices import EXECUTORS, PREFERENCES, SELECTIONS, STRATEGIES, TUNE_MODES as MODES
from privtune.choices import RECOMMEND_DEFAULTS as _RECOMMEND_DEFAULTS
from privtune.choices import TUNE_DEFAULTS as _TUNE_DEFAULTS
from privtune.cli.config_file import explicit_cli_values, resolve_options
from privtune.cli.notices import registration_notice
from privtune.data.datasets import EMBEDDED_IMAGE_DEMO
from privtune.cli.options import data_options, model_options


def run_tune(data=None, **kwargs):
    """:func:`privtune.hpo.tune`, imported when a run starts (it imports torch; ``--help`` must not)."""
    from privtune.hpo.tune import tune

    return tune(data, **kwargs)


def run_recommend(*args, **kwargs):
    """:func:`privtune.hpo.recommend`, imported when called (the hpo package imports torch)."""
    from privtune.hpo.recommend import recommend

    return recommend(*args, **kwargs)


def _number(x: float) -> str:
    """``x`` as a user types it: 1e-5, not Python's 1e-05."""
    return format(x, "g").replace("e-0", "e-").replace("e+0", "e+")


@click.command("tune", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--data", type=str, help="Private training data (.tsv/.csv/.jsonl, an image folder or IDX images; prompt + "
              "response columns tune a causal language model). Default: the embedded SST-2 demo; "
              "embedded:fashion-mnist runs the embedded image demo (EfficientNet-Lite0), embedded:chitchat the "
              "generation demo (SmolLM2-135M).")
@click.option("--eval-data", type=str, help="Reported split: accuracy is computed on it, never used for selection.")
@click.option("--public-eval-data", type=str,
              help="Validation split you declare PUBLIC: scores trials at no privacy cost (prompt → response data "
                   "of at least 20 pairs: one half first fine-tunes the model without noise, the other scores).")
@data_options(labels_default="the labels of --public-eval-data, else the model's")
@click.option("--model", type=str, help="Backbone directory (Hugging Face format). Default: bundled all-MiniLM-L6-v2.")
@model_options()
@click.option("--mode", type=click.Choice(MODES), help="What is trained; auto compares last-layer/bitfit/lora "
              "(bitfit/full when N·ε ≥ 20,000, after last-layer for images; full/bitfit from N = 60,000) with charged "
              "pilots; ties keep the first; "
              "at N·ε ≤ 4,000 it trains last-layer without pilots. "
              f"[default: {_TUNE_DEFAULTS['mode']}]")
@click.option("--time-budget", type=float, help="Minutes the run may take. The plan always logs each mode's time "
              "estimate (backbone size, a timed forward pass); with a budget, --mode auto pilots only the modes that "
              "fit and an explicit mode estimated above it is refused before anything is charged.")
@click.option("--strategy", type=click.Choice(STRATEGIES), help="Tuning strategy (grid-oracle is NOT PRIVATE, "
              f"reference only). [default: {_TUNE_DEFAULTS['strategy']}]")
@click.option("--epsilon", type=float, help=f"TOTAL ε for tuning plus training. [default: {_TUNE_DEFAULTS['epsilon']}]")
@click.option("--delta", type=float, help=f"δ. [default: {_number(_TUNE_DEFAULTS['delta'])}]")
@click.option("--selection", type=click.Choice(SELECTIONS), help="How trials are scored (default: public "
              "validation when given, else charged noisy training accuracy).")
@click.option("--trials", type=int, help="Number of trials (strategy default when unset; linear-scaling: an even "
              "number, two sweeps of trials/2 runs).")
@click.option("--epochs", type=float, help="Epochs of mini-batch runs (hyperfree, bitfit/lora modes).")
@click.option("--steps", type=int, help="Steps of mini-batch runs, instead of --epochs.")
@click.option("--batch-size", type=int, help="Expected batch size; unset = recommended from the budget (Rehn et al., optimal clipping and batch size).")
@click.option("--ledger", type=str, help="Budget ledger URL (default $PRIVTUNE_LEDGER or ~/.privtune/ledger.db; "
              "the embedded demo keeps its ledger in the run directory).")
@click.option("--config", type=str, help="YAML configuration file (flags override it).")
@click.option("--output", type=str, help="Run directory. [default: runs/<timestamp>/]")
@click.option("--seed", type=int, help="Seed (experiments only: it fixes the noise; unset = OS entropy).")
@click.option("--resume", is_flag=True, default=None,
              help="Continue the interrupted run in --output exactly (same options, e.g. --config RUN_DIR/config.yaml): "
                   "its ledger reservation is continued and completed trials are replayed, not recomputed.")
@click.option("--device", type=str, help="Where every trial and the final run train: cpu, cuda, cuda:N or mps "
              "(default: cuda when available, else cpu).")
@click.option("--executor", type=click.Choice(EXECUTORS), help="Where the trials of random-search, linear-scaling "
              "and grid-oracle run: local (this process) or ray (one Ray task per trial; pip install privtune[ray]). "
              f"[default: {_TUNE_DEFAULTS['executor']}]")
@click.option("--ray-address", type=str, help="With --executor ray: auto, local, HOST:PORT or ray://HOST:PORT "
              "(default: $RAY_ADDRESS, else a `ray start` instance on this machine, else a new local one).")
@click.option("--privacy-unit", type=str,
              help="User-level DP: the column of --data naming the person (document, conversation) owning each row. "
                   "Every pilot, trial, charged score and the final run then protect all rows of one unit; "
                   "--batch-size counts units and --delta must be below 1/(number of units). See "
                   "docs/privacy-unit.md.")
@click.option("--max-rows-per-unit", type=int,
              help="With --privacy-unit: the public cap k on one unit's rows per step (default 8).")
@click.option("--max-length", type=int, help="Tokens per text, a public choice: a classifier's input, a generator's "
              "prompt + response (the prompt loses its oldest tokens first). Default 128.")
@click.option("--quiet", is_flag=True, default=None, help="No progress display (log.txt is still written).")
def tune(**kwargs) -> None:
    """Tune hyperparameters privately and train the final model: one (ε, δ) for everything."""
    ctx = click.get_current_context()
    opts = resolve_options("tune", kwargs.get("config"), explicit_cli_values(ctx))
    mapping = {"output": "output_dir"}
    call = {mapping.get(k, k): v for k, v in opts.items() if v is not None}
    result = run_tune(call.get("data"), **{k: v for k, v in call.items() if k != "data"})
    m = result.metrics
    click.echo(f"run directory: {result.run_dir}")
    if m.get("privacy_unit"):
        unit = m["privacy_unit"]
        click.echo(f"privacy unit: {unit['unit']} ({unit['num_units']} units, at most {unit['max_rows_per_unit']} "
                   "rows each per step): the guarantee covers all rows of one unit")
    if m.get("resumed"):
        click.echo(f"resumed: {m['resumed']['replayed_trials']} completed trial(s) replayed, not recomputed; the "
                   "same ledger reservation was continued")
    acc = m.get("accuracy")
    click.echo(f"strategy: {m['strategy']}  mode: {m['mode']}  selection: {m['selection']}")
    if m.get("not_private"):
        click.echo(f"NOT PRIVATE (grid-oracle reference): tuning is not charged and no model is released; the "
                   f"{m['trials']} grid runs compose to ε = {m['epsilon']:.4g}, δ = {m['delta']:g}, above the "
                   f"requested ε = {m['total_epsilon']:g}; the ledger was not touched")
    else:
        trials = (f"{m['trials']} trial(s)" if m.get("trials") is not None else
                  "a random number of trials, of which only the selected one is published (repeat-and-select)")
        if m.get("task") == "text-generation":  # the selected trial is the release: no separate final run
            click.echo(f"certificate: ε = {m['epsilon']:.4f}, δ = {m['delta']:g} (all {trials} charged; the "
                       "selected one is released)")
        else:
            click.echo(f"certificate: ε = {m['epsilon']:.4f}, δ = {m['delta']:g} (tuning included; {trials} + "
                       "final run)")
        if isinstance(m.get("mode_plans"), int) and m["mode_plans"] > 1:
            from privtune.accounting.certificate import union_bound_epsilon

            union = union_bound_epsilon(m["epsilon"], m["mode_plans"], m.get("total_epsilon"))
            click.echo(f"guarantee: ε = {union:g}, δ = {m['delta']:g} (the mode "
                       f"pilots chose one of {m['mode_plans']} plans, each made at δ/{m['mode_plans']}: a union bound "
                       "over the plans; the certificate's ε is that of the events that ran)")
    if m.get("seeded"):
        from privtune.report.release import seeded_notice

        click.echo(seeded_notice(True))
    if acc is not None:
        label = " (NOT PRIVATE)" if m.get("not_private") else ""
        click.echo(f"accuracy on {m.get('reported_split')}: {acc:.4f}{label}")
    if m.get("perplexity") is not None:
        click.echo(f"on {m.get('reported_split')}: perplexity {m['perplexity']:.2f}, BLEU {m['bleu']:.2f}, chrF "
                   f"{m['chrf']:.2f}, ROUGE-L {m['rouge_l']:.2f}")
    label = " (NOT PRIVATE: chosen by an uncharged selection)" if m.get("not_private") else ""
    click.echo(f"hyperparameters{label}: {json.dumps(m['hyperparameters'], default=str)}")
    demo = call.get("data") in (None, EMBEDDED_IMAGE_DEMO, "embedded:chitchat")  # ledger in the run directory
    if m.get("ledger_registered_new_dataset") and not demo:
        click.echo(registration_notice(str(call["data"]), dataset_id=m.get("dataset_id"),
                                       total_epsilon=m["total_epsilon"], delta=m["delta"],
                                       ledger_url=m.get("ledger_url") if call.get("ledger") else None))
    elif m.get("ledger_registered_new_dataset"):  # the embedded demo: its ledger lives in the run directory
        click.echo(f"ledger: new dataset {m.get('dataset_id')} registered with total ε = "
                   f"{m['total_epsilon']:g}, δ = {m['delta']:g}")
    if m.get("ledger_remaining_epsilon") is not None:
        click.echo(f"ledger {m.get('ledger_url')}: remaining ε = {m['ledger_remaining_epsilon']:.4g}")
    click.echo(f"verify with: privtune account --certificate {os.path.join(str(result.run_dir), 'certificate.json')}")


@click.command("recommend", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--epsilon", type=float, required=True, help="Target ε of the training run.")
@click.option("--delta", type=float, required=True, help="δ.")
@click.option("--dataset-size", type=int, required=True, help="Number of training examples N.")
@click.option("--epochs", type=float, required=True, help="Passes over the data E (T = ⌈E·N/B⌉).")
@click.option("--min-steps", type=int, default=_RECOMMEND_DEFAULTS["min_steps"], show_default=True,
              help="Minimum number of optimizer steps.")
@click.option("--plateau-tol", type=float, default=_RECOMMEND_DEFAULTS["plateau_tol"], show_default=True,
              help="Relative tolerance on σ√T defining the plateau.")
@click.option("--prefer", type=click.Choice(PREFERENCES), default=_RECOMMEND_DEFAULTS["prefer"], show_default=True,
              help="smallest B on the plateau (paper) or the largest B with T ≥ min-steps.")
@click.option("--candidates", type=str, help="Comma-separated batch sizes (default: powers of two and N).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def recommend(epsilon, delta, dataset_size, epochs, min_steps, plateau_tol, prefer, candidates, as_json) -> None:
    """Recommend batch size, σ, q, T and clipping guidance for a budget (Rehn et al., optimal clipping
    and batch size for DP transfer learning)."""
    from privtune.errors import InvalidParameterError

    cands = None
    if candidates:
        try:
            cands = [int(x) for x in candidates.split(",") if x.strip()]
        except ValueError:
            raise InvalidParameterError(
                f"`candidates` must be comma-separated integers. Got {candidates!r}. Pass e.g. 256,512,1024."
            ) from None
    r = run_recommend(epsilon, delta, dataset_size, epochs, candidates=cands, min_steps=min_steps,
                      plateau_tol=plateau_tol, prefer=prefer)
    if as_json:
        click.echo(json.dumps(r.to_dict(), indent=2))
    else:
        click.echo(r.format())
