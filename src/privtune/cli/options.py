"""Options that several commands share, declared once (``@data_options(...)`` on every command that reads
a data file), so that a flag one command's error names exists on every command that can raise it."""

from __future__ import annotations

from typing import Callable

import click

LABELS_HELP = ("The label set (public), comma-separated in class-index order, e.g. neg,pos or 0,1 for integer "
               "classes. Default: {default}; never read from the private data.")


def data_options(*, labels_default: str | None = "the model's own labels",
                 label_column_help: str = "Label column name (auto-detected).") -> Callable:
    """``--text-column`` and ``--label-column`` (the loaders' ``text_column``/``label_column``, named by
    their errors), and ``--labels`` unless ``labels_default`` is None (a command that takes the label set
    from the model, such as ``predict``)."""
    options = [
        click.option("--text-column", type=str, help="Text column name (auto-detected)."),
        click.option("--label-column", type=str, help=label_column_help),
    ]
    if labels_default is not None:
        options.append(click.option("--labels", type=str, help=LABELS_HELP.format(default=labels_default)))

    def decorate(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def model_options() -> Callable:
    """``--image-size``, ``--batchnorm`` and ``--image-features``: how a vision backbone is loaded (public choices), on every command
    that loads a backbone by name (``train``, ``tune``).  Their values are checked once, by the configuration
    schema (:mod:`privtune.cli.config_file`), so that a flag and a YAML key give the same error."""
    options = [
        click.option("--image-size", type=int,
                     help="Vision backbones (efficientnet-lite0, timm:ARCH@WEIGHTS, torchvision:ARCH@WEIGHTS): input "
                          "resolution in pixels, a public choice (default 64, or the size the network requires)."),
        # a plain string, not click.Choice: `--batchnorm train` gets its own reason (config_file), not a list
        click.option("--batchnorm", type=str,
                     help="Vision backbones: BatchNorm under DP: eval (default: the pretrained running statistics) "
                          "or group (a GroupNorm in place of each BatchNorm). train is refused: batch statistics "
                          "mix the examples of a batch."),
        click.option("--image-features", type=str,
                     help="Vision backbones: what the head reads: final (default: the network's pooled features) "
                          "or stages (timm backbones: each stage's pooled output too, each L2-normalised; better "
                          "for images unlike ImageNet's; the image demo's default)."),
    ]

    def decorate(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


__all__ = ["data_options", "model_options"]
