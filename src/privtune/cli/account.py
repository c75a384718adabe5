"""``privtune account``: ε of a DP-SGD run (PLD and RDP side by side), σ calibration, certificates."""

from __future__ import annotations

import json
import math

import click

from privtune._validation import (
    check_accounted_noise_multiplier,
    check_choice,
    check_delta,
    check_epsilon,
    check_int,
    check_real,
    check_sample_rate,
    check_steps,
)
from privtune.errors import InfeasibleBudgetError, InvalidParameterError

# choices and defaults come from privtune.choices (checked there against the accountant and DPSGDEvent), so that
# `privtune account --help` imports neither dp-accounting nor scipy; the accountant is imported when a run is shown
from privtune.choices import ACCOUNT_DEFAULTS, ACCOUNTANTS, SAMPLING_SCHEMES

_DEFAULT_ACCOUNTANT = ACCOUNT_DEFAULTS["accountant"]
_DEFAULT_SAMPLING = ACCOUNT_DEFAULTS["sampling"]


def _given(**kw) -> list[str]:
    return [k for k, v in kw.items() if v is not None]


def _resolve_schedule(sample_rate, steps, dataset_size, batch_size, epochs):
    """(q, T, n) from --sample-rate/--steps or --dataset-size/--batch-size/--epochs."""
    alt = _given(**{"--dataset-size": dataset_size, "--batch-size": batch_size, "--epochs": epochs})
    direct = _given(**{"--sample-rate": sample_rate, "--steps": steps})
    n = None
    if dataset_size is not None:
        n = check_int(dataset_size, "--dataset-size", low=1, fix="Pass the number of training examples.")
    if alt and len(alt) < 3 and not (alt == ["--dataset-size"] and len(direct) == 2):
        missing = sorted({"--dataset-size", "--batch-size", "--epochs"} - set(alt))
        raise InvalidParameterError(
            f"`{missing[0]}` is required with {', '.join(alt)}. Got nothing. Pass all of --dataset-size, "
            "--batch-size and --epochs, or --sample-rate and --steps."
        )
    if len(alt) == 3:
        if direct:
            raise InvalidParameterError(
                f"`{direct[0]}` cannot be combined with --dataset-size/--batch-size/--epochs. Got both. "
                "Pass either --sample-rate and --steps, or --dataset-size, --batch-size and --epochs."
            )
        b = check_int(batch_size, "--batch-size", low=1, fix="Pass the expected batch size (≥ 1).")
        if b > n:
            raise InvalidParameterError(
                f"`--batch-size` must be ≤ --dataset-size = {n}. Got {batch_size!r}. Use --batch-size {n} for full batch."
            )
        e = check_real(epochs, "--epochs", low=0.0, fix="Pass the number of passes over the data, e.g. 3.")
        q = b / n
        T = max(1, math.ceil(e * n / b - 1e-9))
        return q, T, n
    if len(direct) < 2:
        missing = [k for k in ("--sample-rate", "--steps") if k not in direct]
        raise InvalidParameterError(
            f"`{missing[0]}` is required. Got nothing. Pass --sample-rate and --steps, or "
            "--dataset-size, --batch-size and --epochs."
        )
    q = check_sample_rate(sample_rate, "--sample-rate")
    T = check_steps(steps, "--steps")
    return q, T, n


def _json_number(x: float) -> float | None:
    """JSON has no infinity: a non-finite ε is written as null (the notes say why)."""
    return x if math.isfinite(x) else None


def _fmt_eps(x: float, digits: int = 4) -> str:
    """Fixed-point for ordinary ε, scientific for astronomically large ones, 'inf' for no guarantee."""
    return f"{x:.{digits}f}" if x < 1e6 else f"{x:.{digits}g}"


def _fmt_count(T: int) -> str:
    return str(T) if T < 10**12 else f"{float(T):.4g}"


def _accountant_label(requested: str, result) -> str:
    """'pld', or 'pld → rdp' when the PLD could not be used (the notes say why)."""
    return requested if result.accountant == requested else f"{requested} → {result.accountant}"


def _print_table(title: str, columns: list[str], rows: list[list[str]], notes: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="left" if c in ("accountant", "event") else "right")
    for r in rows:
        table.add_row(*r)
    console = Console(soft_wrap=True, markup=False)  # event labels are bracketed, "[trial 1/3: lora] …": text, not markup
    console.print(table)
    for n in notes:
        console.print(f"note: {n}", highlight=False)


@click.command("account")
@click.option("--noise-multiplier", "-s", type=float, default=None,
              help="σ: noise std divided by the clipping norm C. Computes ε.")
@click.option("--epsilon", "-e", type=float, default=None, help="Target ε: calibrate σ instead of computing ε.")
@click.option("--delta", "-d", type=float, default=None, help="δ (e.g. 1e-5; must be < 1/n).")
@click.option("--sample-rate", "-q", type=float, default=None, help="Poisson sampling probability q in (0, 1].")
@click.option("--steps", "-T", type=float, default=None, help="Number of optimizer steps T.")
@click.option("--dataset-size", "-n", type=float, default=None, help="n: with --batch-size and --epochs replaces -q/-T.")
@click.option("--batch-size", "-b", type=float, default=None, help="Expected batch size B (q = B/n).")
@click.option("--epochs", type=float, default=None, help="Epochs E (T = ceil(E·n/B)).")
@click.option("--sampling", type=str, default=None,
              help=f"{' | '.join(SAMPLING_SCHEMES)} (shuffle: no amplification).  [default: {_DEFAULT_SAMPLING}]")
@click.option("--accountant", type=str, default=None,
              help=f"Accountant of the headline/JSON result: {' or '.join(ACCOUNTANTS)} (the table shows all).  "
                   f"[default: {_DEFAULT_ACCOUNTANT}]")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--certificate", "certificate", type=str, default=None,
              help="Verify a certificate.json (recompute ε from its events).")
def account(noise_multiplier, epsilon, delta, sample_rate, steps, dataset_size, batch_size, epochs,
            sampling, accountant, as_json, certificate):
    """Compute ε of a DP-SGD run (PLD and RDP side by side), calibrate σ for a target ε
    (--epsilon), or verify a privacy certificate (--certificate FILE).

    \b
    privtune account --noise-multiplier 1.0 --sample-rate 0.01 --steps 5000 --delta 1e-5
    privtune account --epsilon 1 --delta 1e-5 --sample-rate 0.01 --steps 5000
    privtune account --epsilon 3 --delta 1e-6 --dataset-size 60000 --batch-size 256 --epochs 10 --json
    privtune account --certificate runs/x/certificate.json
    """
    if certificate is not None:
        others = _given(**{"--noise-multiplier": noise_multiplier, "--epsilon": epsilon, "--delta": delta,
                           "--sample-rate": sample_rate, "--steps": steps, "--dataset-size": dataset_size,
                           "--batch-size": batch_size, "--epochs": epochs, "--sampling": sampling,
                           "--accountant": accountant})
        if others:
            raise InvalidParameterError(
                f"`{others[0]}` cannot be combined with --certificate. Got both. The certificate holds its own "
                f"events, δ and accountant: pass only --certificate FILE (and --json), or drop --certificate "
                f"to compute ε for {', '.join(others)}."
            )
    accountant = check_choice(_DEFAULT_ACCOUNTANT if accountant is None else accountant, "--accountant", ACCOUNTANTS)
    sampling = check_choice(_DEFAULT_SAMPLING if sampling is None else sampling, "--sampling", SAMPLING_SCHEMES)
    if certificate is not None:
        _show_certificate(certificate, as_json)
        return 0

    if delta is None:
        raise InvalidParameterError("`--delta` is required. Got nothing. Pass e.g. --delta 1e-5 (well below 1/n).")
    q, T, n = _resolve_schedule(sample_rate, steps, dataset_size, batch_size, epochs)
    delta = check_delta(delta, "--delta", dataset_size=n)
    if sampling == "full_batch" and q != 1.0:
        raise InvalidParameterError(f"`--sample-rate` must be 1 with --sampling full_batch. Got {q!r}.")
    if q == 1.0 and sampling == "poisson":
        sampling = "full_batch"

    if (noise_multiplier is None) == (epsilon is None):
        raise InvalidParameterError(
            "`--noise-multiplier` / `--epsilon`: pass exactly one of them. Got "
            f"{'both' if noise_multiplier is not None else 'neither'}. --noise-multiplier computes ε; "
            "--epsilon calibrates σ."
        )
    if noise_multiplier is not None:
        sigma = check_accounted_noise_multiplier(noise_multiplier, "--noise-multiplier")
        _show_epsilon(sigma, q, T, n, delta, sampling, accountant, as_json)
    else:
        _show_calibration(check_epsilon(epsilon, "--epsilon"), q, T, n, delta, sampling, accountant, as_json)
    return 0


def _show_certificate(certificate: str, as_json: bool) -> None:
    """Verify ``certificate`` (recompute ε from its events) and print it as JSON or as a table."""
    from privtune import accounting as A
    from privtune.accounting.certificate import privacy_statement, union_bound_epsilon

    cert = A.verify_certificate(certificate)
    if as_json:
        # ε as certificate.json writes it: a number, or "inf" for NOT PRIVATE events (never null)
        click.echo(json.dumps({"verified": True, "epsilon": cert.to_dict()["epsilon"], "private": cert.private,
                               "label": cert.metadata.get("label"), "delta": cert.delta,
                               "accountant": cert.accountant, "events": len(cert.events),
                               "neighbouring": cert.neighbouring, "path": certificate}, allow_nan=False))
        return
    rows = [[A.describe_event(e)] for e in cert.events]
    # a run labelled NOT PRIVATE (seeded: its noise can be drawn again) says so before the DP sentence
    guarantee = (privacy_statement(cert.neighbouring) if cert.private else
                 f"{cert.metadata.get('label') or 'NOT PRIVATE'}: no guarantee for this release; its events alone "
                 f"would give {privacy_statement(cert.neighbouring)}")
    plans = cert.metadata.get("mode_plans")
    union = union_bound_epsilon(cert.epsilon, plans, cert.metadata.get("total_epsilon_requested"))
    if cert.private and union != cert.epsilon:
        # --mode auto: the events that ran are one of `plans` plans, each made at δ/plans (docs/accounting.md)
        guarantee += (f"; the run's guarantee is (ε = {union:g}, δ = {cert.delta:g}) by a union "
                      f"bound over the {plans} mode plans its pilots chose among, each made at δ/{plans}")
    _print_table(f"certificate {certificate}: VERIFIED", ["event"], rows,
                 [f"ε = {cert.epsilon:.6g}, δ = {cert.delta:g}, accountant {cert.accountant}, "
                  f"{cert.neighbouring}", guarantee] + list(cert.sampling_assumptions)
                 + list(cert.notes))


def _show_epsilon(sigma: float, q: float, T: int, n: int | None, delta: float, sampling: str, accountant: str,
                  as_json: bool) -> None:
    """Print ε of T steps at noise multiplier σ and sample rate q under every accountant (the JSON headline
    is ``accountant``'s); ``n`` is the dataset size if given (examples), echoed in the JSON."""
    from privtune import accounting as A

    results = {a: A.account(A.DPSGDEvent(sigma, q, T, sampling=sampling), delta, a) for a in A.ACCOUNTANTS}
    main = results[accountant]
    if as_json:
        click.echo(json.dumps({
            "epsilon": _json_number(main.epsilon), "delta": delta, "noise_multiplier": sigma, "sample_rate": q,
            "steps": T, "accountant": main.accountant, "requested_accountant": accountant, "sampling": sampling,
            "epsilons": {a: _json_number(r.epsilon) for a, r in results.items()},
            "dataset_size": n, "notes": main.notes,
        }))
        return
    rows = [[_accountant_label(a, r), _fmt_eps(r.epsilon), f"{delta:g}", f"{sigma:g}", f"{q:g}", _fmt_count(T)]
            for a, r in results.items()]
    notes = list(results["pld"].notes) + [n for n in results["rdp"].notes if n not in results["pld"].notes]
    _print_table("privtune account: ε (add/remove one example)",
                 ["accountant", "ε", "δ", "σ", "q", "T"], rows, notes)


def _show_calibration(target: float, q: float, T: int, n: int | None, delta: float, sampling: str,
                      accountant: str, as_json: bool) -> None:
    """Print the noise multiplier σ (noise std / clipping norm) each accountant calibrates for the ``target``
    ε at (δ, q, T), with the ε it achieves; the JSON headline is ``accountant``'s."""
    from privtune import accounting as A

    sigmas = {}
    for a in A.ACCOUNTANTS:
        try:
            sigmas[a] = A.calibrate_noise_multiplier(target, delta, q, T, a, sampling=sampling)
        except InfeasibleBudgetError as exc:  # name the flag, not the Python argument
            raise InfeasibleBudgetError(str(exc).replace("`target_epsilon`", "`--epsilon`")) from None
    checked = {a: A.account(A.DPSGDEvent(s, q, T, sampling=sampling), delta, a) for a, s in sigmas.items()}
    achieved = {a: r.epsilon for a, r in checked.items()}
    # notes worth showing: why an accountant fell back or stopped refining (not the routine interval note)
    notes = [n for r in checked.values() for n in r.notes if not n.startswith("PLD value discretisation interval")]
    notes = list(dict.fromkeys(notes))
    if as_json:
        click.echo(json.dumps({
            "epsilon": achieved[accountant], "target_epsilon": target, "delta": delta,
            "noise_multiplier": sigmas[accountant], "sample_rate": q, "steps": T,
            "accountant": checked[accountant].accountant, "requested_accountant": accountant,
            "sampling": sampling, "noise_multipliers": sigmas, "dataset_size": n, "notes": notes,
        }))
        return
    rows = [[_accountant_label(a, checked[a]), f"{sigmas[a]:.5f}", _fmt_eps(achieved[a], 5), f"{target:g}",
             f"{delta:g}", f"{q:g}", _fmt_count(T)] for a in A.ACCOUNTANTS]
    _print_table("privtune account: calibrated σ (noise std / clipping norm)",
                 ["accountant", "σ", "achieved ε", "target ε", "δ", "q", "T"], rows, notes)
