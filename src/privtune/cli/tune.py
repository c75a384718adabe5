"""``privtune tune`` and ``privtune recommend``: thin click edges over :func:`privtune.hpo.tune`
and :func:`privtune.hpo.recommend`.

::

    privtune tune [--data FILE] [--labels neg,pos] [--eval-data FILE] [--model PATH] [--mode M|auto] [--strategy S] [--epsilon E]
                  [--delta D] [--ledger URL] [--config FILE] [--output RUN_DIR] [--device D] [--resume] [--quiet]
    privtune recommend --epsilon E --delta D --dataset-size N --epochs K [--json]

With no arguments ``privtune tune`` runs the embedded demo: the SST-2 subset shipped with
privtune, the bundled MiniLM, total ε = 1, δ = 1e-5, its ledger inside the run directory.
"""

from __future__ import annotations

import json
import os

import click

MODES = ("auto", "last-layer", "bitfit", "lora", "full")
STRATEGIES = ("linear-scaling", "hyperfree", "single-step", "random-search", "grid-oracle")
SELECTIONS = ("public-validation", "private-validation", "train-accuracy", "train-loss")

# defaults applied after the YAML file and the flags are merged (flags win over the file)
_DEFAULTS = {"mode": "auto", "strategy": "hyperfree", "epsilon": 1.0, "delta": 1e-5}


def _explicit(ctx: click.Context) -> dict:
    try:
        from privtune.config import explicit_cli_values
    except ImportError:  # pragma: no cover
        return {k: v for k, v in ctx.params.items()
                if ctx.get_parameter_source(k) == click.core.ParameterSource.COMMANDLINE and k != "config"}
    return explicit_cli_values(ctx)


def _resolve(config: str | None, values: dict) -> dict:
    try:
        from privtune.config import resolve_options
    except ImportError:  # pragma: no cover
        if config is not None:
            raise click.UsageError("--config needs privtune.config, which is not installed.")
        return dict(values)
    return resolve_options("tune", config, values)


@click.command("tune", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--data", type=str, help="Private training data (.tsv/.csv/.jsonl). Default: the embedded SST-2 demo.")
@click.option("--eval-data", type=str, help="Reported split: accuracy is computed on it, never used for selection.")
@click.option("--public-eval-data", type=str,
              help="Validation split you declare PUBLIC: scores trials at no privacy cost.")
@click.option("--labels", type=str,
              help="The label set (public), comma-separated in class-index order, e.g. neg,pos or 0,1 for integer "
                   "classes. Default: the labels of --public-eval-data, else the model's; never read from the "
                   "private data.")
@click.option("--model", type=str, help="Backbone directory (Hugging Face format). Default: bundled all-MiniLM-L6-v2.")
@click.option("--mode", type=click.Choice(MODES), help="What is trained; auto compares last-layer/bitfit/lora "
              "with charged pilots. [default: auto]")
@click.option("--strategy", type=click.Choice(STRATEGIES), help="Tuning strategy (grid-oracle is NOT PRIVATE, "
              "reference only). [default: hyperfree]")
@click.option("--epsilon", type=float, help="TOTAL ε for tuning plus training. [default: 1.0]")
@click.option("--delta", type=float, help="δ. [default: 1e-5]")
@click.option("--selection", type=click.Choice(SELECTIONS), help="How trials are scored (default: public "
              "validation when given, else charged noisy training accuracy).")
@click.option("--trials", type=int, help="Number of trials (strategy default when unset; linear-scaling: an even "
              "number, two sweeps of trials/2 runs).")
@click.option("--epochs", type=float, help="Epochs of mini-batch runs (hyperfree, bitfit/lora modes).")
@click.option("--steps", type=int, help="Steps of mini-batch runs, instead of --epochs.")
@click.option("--batch-size", type=int, help="Expected batch size; unset = recommended (seed 003).")
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
@click.option("--quiet", is_flag=True, default=None, help="No progress display (log.txt is still written).")
def tune(**kwargs) -> None:
    """Tune hyperparameters privately and train the final model: one (ε, δ) for everything."""
    ctx = click.get_current_context()
    opts = _resolve(kwargs.get("config"), _explicit(ctx))
    for k, v in _DEFAULTS.items():
        opts.setdefault(k, v)
    from privtune.hpo import tune as run_tune

    mapping = {"output": "output_dir"}
    call = {mapping.get(k, k): v for k, v in opts.items() if v is not None}
    result = run_tune(call.pop("data", None), **call)
    m = result.metrics
    click.echo(f"run directory: {result.run_dir}")
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
        click.echo(f"certificate: ε = {m['epsilon']:.4f}, δ = {m['delta']:g} (tuning included; "
                   f"{m['trials']} trial(s) + final run)")
    if acc is not None:
        label = " (NOT PRIVATE)" if m.get("not_private") else ""
        click.echo(f"accuracy on {m.get('reported_split')}: {acc:.4f}{label}")
    label = " (NOT PRIVATE: chosen by an uncharged selection)" if m.get("not_private") else ""
    click.echo(f"hyperparameters{label}: {json.dumps(m['hyperparameters'], default=str)}")
    if m.get("ledger_registered_new_dataset"):
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
@click.option("--min-steps", type=int, default=20, show_default=True, help="Minimum number of optimizer steps.")
@click.option("--plateau-tol", type=float, default=0.10, show_default=True,
              help="Relative tolerance on σ√T defining the plateau.")
@click.option("--prefer", type=click.Choice(("smallest", "cap")), default="smallest", show_default=True,
              help="smallest B on the plateau (paper) or the largest B with T ≥ min-steps.")
@click.option("--candidates", type=str, help="Comma-separated batch sizes (default: powers of two and N).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def recommend(epsilon, delta, dataset_size, epochs, min_steps, plateau_tol, prefer, candidates, as_json) -> None:
    """Recommend batch size, σ, q, T and clipping guidance for a budget (seed 003)."""
    from privtune.errors import InvalidParameterError
    from privtune.hpo import recommend as rec_fn

    cands = None
    if candidates:
        try:
            cands = [int(x) for x in candidates.split(",") if x.strip()]
        except ValueError:
            raise InvalidParameterError(
                f"`candidates` must be comma-separated integers. Got {candidates!r}. Pass e.g. 256,512,1024."
            ) from None
    r = rec_fn(epsilon, delta, dataset_size, epochs, candidates=cands, min_steps=min_steps,
               plateau_tol=plateau_tol, prefer=prefer)
    if as_json:
        click.echo(json.dumps(r.to_dict(), indent=2))
    else:
        click.echo(r.format())
