"""``privtune audit``: a thin click edge over :func:`privtune.audit.audit` (its options build the
:class:`~privtune.audit.specs.AuditSpec`).

::

    privtune audit --data FILE --mode {full,bitfit,last-layer,lora} (--epsilon E [--delta D] | --noise-multiplier S)
                   [--epochs N | --steps N] [--batch-size B] [--canaries M] [--no-blackbox] [--public-data]
                   [--labels neg,pos] [--ledger URL] [--output DIR [--resume]]   (charged: runs/audit-<time>)
                   [--privacy-unit COLUMN [--max-rows-per-unit K] [--canary-rows R]]
                   [--canary-digits K] [--candidates S] [--no-reference]    (prompt → response data)
                   [--image-size PX] [--batchnorm eval|group] [--image-features final|stages]   (images)

Prints, per audit (white-box and black-box): the claimed ε, the empirical lower bound at 95 %
confidence, m, the number of guesses and of correct guesses, and a verdict; on prompt → response data
also the exposure table of the canaries (DP model, and the NOT PRIVATE non-private reference).  Exit
status 0 when every lower bound is ≤ the claimed ε, 1 when one exceeds it (the claim is contradicted),
2 on a usage error.
"""

from __future__ import annotations

import click

# from privtune.choices, which imports nothing: `privtune audit --help` and a usage error do not import torch
from privtune.choices import ACCOUNTANTS, CLIPPINGS, OPTIMIZERS, TRAIN_MODES
from privtune.cli.options import data_options, model_options

# an audit trains one configuration: two-phase (two events) is audited phase by phase
MODES = tuple(m for m in TRAIN_MODES if m != "two-phase")
#: the options that say where the audit reads and writes (audit()'s keywords); the rest build its AuditSpec
_INPUTS = ("data", "model", "labels", "text_column", "label_column", "max_length", "ledger", "device", "resume",
           "quiet", "image_size", "batchnorm", "image_features")


@click.command("audit", context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--data", type=str, required=True,
              help="Training data: .tsv/.csv/.jsonl (text + label columns, or prompt + response columns), an image "
                   "folder (one sub-folder per class) or IDX images file, or embedded:chitchat.")
@click.option("--model", type=str,
              help="Backbone directory. Default: bundled all-MiniLM-L6-v2 (prompt → response data: a causal LM "
                   "name or directory; smollm2-135m for embedded:chitchat; images: a vision backbone, e.g. "
                   "efficientnet-lite0, named here).")
@click.option("--mode", type=click.Choice(MODES), default=None,
              help="What is trained. Default: bitfit; lora on prompt → response data.")
@click.option("--epsilon", type=float, help="Claimed ε of the configuration (with --delta).")
@click.option("--delta", type=float, help="δ (default: min(1e-5, <1/(10·N))).")
@click.option("--noise-multiplier", type=float, help="σ instead of --epsilon.")
@click.option("--epochs", type=float, help="Passes over the data (default 3).")
@click.option("--steps", type=int, help="Optimizer steps (instead of --epochs).")
@click.option("--batch-size", type=int, help="Expected Poisson batch size B (default min(N, 256)).")
@click.option("--learning-rate", type=float, help="Learning rate (default by mode).")
@click.option("--clip", type=float, default=1.0, help="Per-example clipping norm C.")
@click.option("--clipping", type=click.Choice(CLIPPINGS), default="flat", help="Clipping style.")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="adam", help="Optimizer.")
@click.option("--sampling", type=click.Choice(("poisson", "full_batch")), default="poisson", help="Batch sampling.")
@click.option("--accountant", type=click.Choice(ACCOUNTANTS), default="pld", help="Privacy accountant.")
@click.option("--canaries", "num_canaries", type=int, default=None,
              help="Number m of canaries per audit. Default: 1000; 100 on prompt → response data.")
@click.option("--privacy-unit", type=str, help="Audit the user-level configuration: the column of --data naming "
              "each row's unit. The canaries are then units of --canary-rows rows each, in or out whole (on prompt → "
              "response data the same secret each time); --batch-size counts units. See docs/privacy-unit.md.")
@click.option("--max-rows-per-unit", type=int, help="With --privacy-unit: the public cap k on one unit's rows per "
              "step (default 8).")
@click.option("--canary-rows", type=int, help="With --privacy-unit: rows r of each canary unit, all pulling the "
              "same way (default k: the most one unit can put into a step).")
@click.option("--canary-digits", type=int, default=6,
              help="Prompt → response data: digits of each secret canary (|R| = 10^K candidate secrets).")
@click.option("--candidates", type=int, default=2000,
              help="Prompt → response data: secrets scored to rank each canary (all of R when it is smaller).")
@click.option("--reference/--no-reference", default=True,
              help="Prompt → response data: also train a non-private reference and show its exposures (NOT "
                   "PRIVATE; not charged, not released).")
@click.option("--whitebox/--no-whitebox", default=True, help="White-box audit of the DP step (uses no data).")
@click.option("--blackbox/--no-blackbox", default=True,
              help="Black-box audit: one real training run on --data plus canaries (charged to the ledger).")
@click.option("--public-data", is_flag=True, default=False,
              help="Declare --data public: the black-box run is not charged to the ledger.")
@click.option("--ledger", type=str, help="Budget ledger URL (default $PRIVTUNE_LEDGER or ~/.privtune/ledger.db).")
@click.option("--output", type=str, help="Write whitebox/ and blackbox/ (audit.json, audit.png, audit.html) here; "
              "memorisation/exposure.json on prompt → response data. [default for a charged audit: "
              "runs/audit-<timestamp>/, where --resume can finish it if it is interrupted]")
@click.option("--confidence", type=float, default=0.95, help="Confidence 1 − β of the lower bounds.")
@click.option("--seed", type=int, help="Seed for canaries, membership and training (experiments).")
@data_options()
@model_options()
@click.option("--max-length", type=int,
              help="Tokens per example (default: as train; 128 per prompt + response for a causal LM).")
@click.option("--max-physical-batch-size", type=int, default=32, help="Micro-batch size in memory.")
@click.option("--device", type=str, help="cpu, cuda, cuda:N or mps (default: cuda when available, else cpu).")
@click.option("--resume", is_flag=True, default=False,
              help="Finish an interrupted audit in --output (same arguments): its ledger reservation is reused, "
                   "never charged twice.")
@click.option("--quiet", is_flag=True, default=False, help="No progress display.")
def audit(**opts) -> int:
    """Measure an empirical lower bound on ε of a training configuration in one run (Steinke et al. 2023).

    The black-box audit trains once on your data (plus synthetic canaries) and is charged to the
    dataset's budget in the ledger like `privtune train` (unless --public-data); no model is released.
    A lower bound is evidence, not proof: above the claimed ε it shows a bug; below it, it proves nothing.

    On prompt → response data the canaries are secret digit codes ("my secret code is 3 9 1 4 7 2") and
    the audit also reports each one's exposure (Carlini et al. 2019) in the DP model and in a non-private
    reference (NOT PRIVATE). On image data they are images of random pixels with random labels.
    """
    # deferred: the audit and its specs import torch and the training stack (`privtune audit --help` stays fast)
    from privtune.audit.blackbox import AuditInputs, run_audit
    from privtune.audit.specs import AuditSpec

    output = opts.pop("output")
    inputs = {name: opts.pop(name) for name in _INPUTS}
    spec = AuditSpec.create(**opts)
    announce = None
    if output is None and spec.blackbox and not spec.public_data:
        # a charged audit keeps its seeds in its output directory until it is written: with one always there, an
        # interrupted audit can be finished with --resume instead of being charged again
        from privtune._release import default_run_dir

        output = str(default_run_dir("audit"))

        def announce(folder) -> None:  # after every check, before the charge: an audit its checks refuse names no folder
            click.echo(f"output: {folder}/ (if the audit is interrupted, the same command with --output {folder} "
                       "--resume finishes it without a new charge)")

    report = run_audit(spec, AuditInputs(output_dir=output, progress=not inputs.pop("quiet"), on_output_ready=announce,
                                         **inputs))
    click.echo(report.summary())
    if output:
        audits = [name for name in ("whitebox", "blackbox") if getattr(report, name) is not None]
        shown = audits[0] if len(audits) == 1 else "{" + ",".join(audits) + "}"
        click.echo(f"\nwritten: {report.output_dir}/{shown}/audit.{{json,png,html}}"
                   + (f", {report.output_dir}/memorisation/exposure.json" if report.memorisation else ""))
    return 1 if report.violation else 0
