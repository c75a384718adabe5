"""``privtune report RUN_DIR``: regenerate the HTML report (and the model card) of a finished run."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("report")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--model-card/--no-model-card", default=True, show_default=True,
              help="Also rewrite RUN_DIR/model/README.md when RUN_DIR/model/ exists.")
def report(run_dir: Path, model_card: bool) -> None:
    """Regenerate RUN_DIR/report.html (self-contained; open it in any browser) and its PNG plots."""
    from privtune.report import write_report

    out = write_report(run_dir)
    click.echo(f"wrote {out}")
    if model_card and (run_dir / "model").is_dir():
        from privtune.report import write_model_card

        click.echo(f"wrote {write_model_card(run_dir)}")
    cert = run_dir / "certificate.json"
    if cert.exists():
        # the report states the problem inside; the exit status must say it too (scripts check it)
        from privtune.accounting import verify_certificate
        from privtune.errors import CertificateError, PrivtuneError

        try:
            verify_certificate(cert)
        except (PrivtuneError, OSError) as exc:
            raise CertificateError(
                f"{cert} cannot be verified, so the report has no trustworthy privacy guarantee: {exc}"
            ) from None
