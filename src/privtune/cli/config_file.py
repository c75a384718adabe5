"""YAML configuration files for ``privtune train`` and ``privtune tune``: the schema, its loader and writer.

A configuration file is a flat YAML mapping whose keys are the command's long flags in
snake_case (``--learning-rate`` is ``learning_rate``)::

    # run.yaml
    data: train.tsv
    eval_data: dev.tsv
    mode: bitfit
    epsilon: 1.0
    delta: 1e-5

A file may instead (or additionally) hold one section per command, ``train:`` and
``tune:``; top-level keys then apply to both commands and the command's own section
overrides them.  Precedence, highest first: flags given on the command line, the file,
the function's defaults (which live in :func:`privtune.training.train` and
:func:`privtune.hpo.tune`, not here).

Unknown keys and values of the wrong type are rejected with the key's name, the value,
what is allowed and, for typos, the closest valid key.  ``null`` means "not set" (use
the default).  ``1e-5`` is read as a number (plain PyYAML would read it as a string).
Relative paths are kept as written: they are relative to the working directory, exactly
like the same path given as a flag.

Public functions:

* :func:`resolve_options` merges a file under the flags the user actually set.
* :func:`save_effective_config` writes ``RUN_DIR/config.yaml`` (loadable with ``--config``).
* :func:`template` returns the commented template ``privtune config init`` writes.
* :func:`check_config_file` validates a file for one or both commands.
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

# Every choice set is declared once, in privtune.choices, which imports nothing: reading, checking and
# templating a configuration file loads neither torch nor the tuning stack (tests/test_cli_option_sources.py
# fails on a second declaration, tests/test_choices.py when an implementation disagrees).
from privtune.choices import (
    ACCOUNTANTS,
    BATCHNORM_POLICIES,
    BATCHNORM_TRAIN_REFUSAL,
    CLIPPINGS as CLIPPING,
    IMAGE_FEATURES,
    IMAGE_SIZE_BOUNDS,
    EXECUTORS,
    OPTIMIZERS,
    SAMPLING_SCHEMES as SAMPLING,
    SELECTIONS as TUNE_SELECTIONS,
    STRATEGIES,
    TRAIN_MODES,
    TUNE_MODES,
)
from privtune.errors import InvalidParameterError

#: the commands a configuration file configures
COMMANDS = ("train", "tune")


@dataclass(frozen=True)
class Option:
    """One configuration key.

    ``kind`` is one of ``"path"``, ``"str"``, ``"float"``, ``"int"``, ``"number"`` (int or
    float), ``"bool"``, ``"choice"``, ``"mapping"``, ``"str_list"`` (a list of names, or one
    comma-separated string), ``"label_list"`` (like ``str_list``, integers allowed: class labels).  ``low``/``high`` bound numbers
    (``low`` exclusive, ``high`` inclusive unless ``high_exclusive``).  ``example`` is the
    value shown in the template; ``active`` makes the template set it instead of showing
    it commented out.
    """

    key: str
    kind: str
    help: str
    example: Any = None
    choices: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None
    high_exclusive: bool = False
    low_inclusive: bool = False
    active: bool = False
    #: values refused with a reason of their own (value -> why, what to use instead) rather than "must be one of"
    refused: tuple[tuple[str, str], ...] = ()


def _common(mode_choices: tuple[str, ...], mode_example: str, data_active: bool) -> list[Option]:
    return [
        Option("data", "path", "Training data: a .tsv/.csv/.jsonl file (text and label columns) or an image folder.",
               "train.tsv", active=data_active),
        Option("eval_data", "path", "Evaluation split (accuracy is reported on it; never used to select trials).",
               "dev.tsv"),
        Option("text_column", "str", "Name of the text column (auto-detected when unset).", "sentence"),
        Option("label_column", "str", "Name of the label column (auto-detected when unset).", "label"),
        Option("labels", "label_list", "The label set, PUBLIC input, in class-index order (class i is the i-th "
               "label): names, or the integer classes 0..K-1. Unset = the public split's or the model's labels; "
               "never read from the private data.", ["neg", "pos"]),
        Option("model", "path", "Pretrained model directory (Hugging Face format); unset = bundled all-MiniLM-L6-v2.",
               "path/to/pretrained-model"),
        Option("image_size", "int", "Vision backbones (efficientnet-lite0, timm:ARCH@WEIGHTS, torchvision:ARCH@WEIGHTS): "
               "the input resolution in pixels, a public choice (unset = 64, or the size the network requires).", 64,
               low=IMAGE_SIZE_BOUNDS[0], high=IMAGE_SIZE_BOUNDS[1], low_inclusive=True),
        Option("batchnorm", "choice", "Vision backbones: what DP training does with BatchNorm: eval (the pretrained "
               "running statistics; unset = eval) or group (a GroupNorm in place of each BatchNorm); train is "
               "refused (batch statistics mix examples).", "eval", choices=BATCHNORM_POLICIES,
               refused=(("train", BATCHNORM_TRAIN_REFUSAL),)),
        Option("image_features", "choice", "Vision backbones: what the head reads: final (the network's pooled "
               "features; unset = final, the image demo: stages) or stages (timm backbones: each stage's pooled "
               "output too, each L2-normalised).", "stages", choices=IMAGE_FEATURES),
        Option("mode", "choice", "What is trained: " + ", ".join(mode_choices) + ".", mode_example,
               choices=mode_choices, active=True),
        Option("epsilon", "float", "Privacy budget ε (total, tuning included for `tune`).", 1.0, low=0.0,
               active=True),
        Option("delta", "float", "Privacy parameter δ, well below 1/(number of training examples).", 1e-5,
               low=0.0, high=1.0, high_exclusive=True, active=True),
        Option("accountant", "choice", "Privacy accountant: " + ", ".join(ACCOUNTANTS) + " (pld: tight, the default).", "pld",
               choices=ACCOUNTANTS),
    ]


#: user-level DP, for train and tune alike (docs/privacy-unit.md)
_UNIT_OPTIONS = [
    Option("privacy_unit", "str", "User-level DP: the column naming the person (document, conversation) owning each "
           "row; the guarantee is then for adding or removing all rows of one unit, batch_size counts units and "
           "delta must be below 1/(number of units). Unset = one row (docs/privacy-unit.md).", "user_id"),
    Option("max_rows_per_unit", "int", "With privacy_unit: the public cap k on the rows of one unit used in a step "
           "(a fresh random k each step).", 8, low=0.0),
]

_TRAIN: list[Option] = [
    *_common(TRAIN_MODES, "bitfit", data_active=True),
    Option("noise_multiplier", "float",
           "σ, the noise std divided by the clipping norm; give it INSTEAD of epsilon to fix the noise.", 1.0,
           low=0.0),
    Option("epochs", "number", "Passes over the data (give epochs or steps, not both).", 3, low=0.0),
    Option("steps", "int", "Optimizer steps (give epochs or steps, not both).", 1000, low=0.0),
    Option("phase1_epochs", "number", "two-phase mode: epochs of DP full fine-tuning before DP-BiTFiT.", 1,
           low=0.0),
    Option("batch_size", "int", "Expected (logical) batch size; Poisson sampling rate q = batch_size / n.", 256,
           low=0.0),
    Option("max_physical_batch_size", "int",
           "Largest micro-batch held in memory; accumulation does not change the result.", 32, low=0.0),
    *_UNIT_OPTIONS,
    Option("learning_rate", "float", "Learning rate η.", 1e-3, low=0.0),
    Option("backbone_lr_scale", "float", "α in (0, 1]: the head trains at the learning rate, every other trainable "
           "parameter at α times it (Mehta et al.'s pre-trained-layer multiplier, large-scale transfer; unset = "
           "0.1 for full, else 1).", 0.1, low=0.0, high=1.0),
    Option("clip", "float", "Clipping norm C (per-example gradient L2 norm bound).", 1.0, low=0.0),
    Option("clipping", "choice", "Clipping rule: " + ", ".join(CLIPPING) + " (flat: Abadi, min(1, C/||g||); "
           "automatic: AUTO-S).", "flat", choices=CLIPPING),
    Option("per_layer_clipping", "bool", "Clip each layer to C/sqrt(K) (K layers) instead of the whole gradient "
           "to C; the sensitivity, σ and ε are unchanged.", False),
    Option("optimizer", "choice", "Optimizer applied to the privatised gradient: " + ", ".join(OPTIMIZERS) + ".", "adam",
           choices=OPTIMIZERS),
    Option("sampling", "choice",
           "poisson (amplification accounted), shuffle (accounted without amplification) or full_batch.",
           "poisson", choices=SAMPLING),
    Option("assume_poisson", "bool",
           "Only with `sampling: shuffle`: account the shuffled batches AS IF Poisson sampled (an assumption, not a "
           "proof; recorded in the certificate).", False),
    Option("lora_rank", "int", "Only with `mode: lora`: LoRA rank r (default 8).", 8, low=1, low_inclusive=True),
    Option("lora_alpha", "float", "Only with `mode: lora`: LoRA scaling alpha; the update is alpha/r * B A (default 16).",
           16.0, low=0.0),
    Option("lora_target_modules", "str_list",
           "Only with `mode: lora`: names of the modules that get adapters (default per architecture).",
           ["query", "value"]),
    Option("device", "str", "Where to train: cpu, cuda, cuda:N or mps; unset = cuda when available, else cpu.",
           "cpu"),
    Option("clipping_diagnostics", "bool",
           "Record clipping diagnostics. NOT PRIVATE: reads private data without noise.", False),
    Option("ledger", "str", "Budget ledger URL (sqlite:///PATH or postgresql://...); unset = $PRIVTUNE_LEDGER or "
           "~/.privtune/ledger.db.", "sqlite:///ledger.db"),
    Option("output", "path", "Run directory (model/, certificate.json, report.html, ...).", "runs/my-run",
           active=True),
    Option("seed", "int", "Seed for data order and noise (experiments only; unset = OS entropy for the noise).", 0,
           low=0, low_inclusive=True),
    Option("resume", "bool", "Continue an interrupted run in `output` exactly where it stopped.", False),
    Option("quiet", "bool", "No progress display (the log file RUN_DIR/log.txt is still written).", False),
]

_TUNE: list[Option] = [
    *_common(TUNE_MODES, "auto", data_active=False),
    Option("max_length", "int", "Tokens per text, a public choice: a classifier's input, a generator's prompt + "
           "response (the prompt loses its oldest tokens first); unset = 128.", 128, low=1.0),
    Option("strategy", "choice", "Tuning strategy: " + ", ".join(STRATEGIES)
           + " (grid-oracle is NOT PRIVATE: a reference only).", "hyperfree", choices=STRATEGIES, active=True),
    Option("public_eval_data", "path",
           "Validation split you declare PUBLIC, used to score trials at no privacy cost (prompt → response data "
           "of at least 20 pairs: one half first fine-tunes the model without noise, the other scores).",
           "public_dev.tsv"),
    Option("selection", "choice", "How trials are scored: " + ", ".join(TUNE_SELECTIONS) + " (the last three are "
           "charged); unset = public-validation when public_eval_data is given, else train-accuracy.", "train-loss",
           choices=TUNE_SELECTIONS),
    Option("selection_noise", "float", "σ of a charged selection score (noise std of the correct-count); unset = "
           "max(5, 0.5 % of the scored examples).", 20.0, low=0.0),
    Option("validation_fraction", "float", "Fraction of the training data held out as the private validation "
           "split when selection is private-validation (its scores are charged).", 0.1, low=0.0, high=0.5),
    Option("trials", "int", "Number of tuning trials of linear-scaling / random-search (unset = the strategy's "
           "default; strategies without trials refuse it).", 6, low=0.0),
    Option("epochs", "number", "Passes over the data of the final run.", 3, low=0.0),
    Option("steps", "int", "Optimizer steps of the final run (instead of epochs).", 1000, low=0.0),
    Option("batch_size", "int", "Expected batch size; unset = recommended from the budget (Rehn et al.).", 256,
           low=0.0),
    Option("max_physical_batch_size", "int", "Largest micro-batch held in memory.", 32, low=0.0),
    Option("clip", "float", "Clipping norm C of the strategy's runs (unset = 1; hyperfree always clips at 1).",
           1.0, low=0.0),
    Option("clipping", "choice", "flat or automatic (AUTO-S); for hyperfree (default: AUTO-S on features, flat "
           "on a model) and linear-scaling with bitfit/lora/full; other strategies refuse it.", "flat",
           choices=CLIPPING),
    Option("optimizer", "choice", "Optimizer applied to the privatised gradient: " + ", ".join(OPTIMIZERS) + ".", "adam",
           choices=OPTIMIZERS),
    Option("strategy_options", "mapping", "Extra parameters of the strategy's config (docs/strategies.md); the keys "
           "depend on the strategy, e.g. hyperfree: interval, lr0, gamma_noise; linear-scaling: runs_per_sweep, "
           "lr_bounds, sweep_epsilons; random-search: trials, accounting; single-step: optimizer.",
           {"interval": 5, "gamma_noise": 1.01}),
    Option("time_budget", "float", "Minutes the run may take: the plan prices every mode from the backbone's size "
           "and a timed forward pass (always logged); with a budget, mode auto pilots only the modes estimated to "
           "fit and an explicit mode estimated above it is refused before anything is charged.", 60.0, low=0.0),
    Option("nonprivate_reference", "bool",
           "Also train a non-private reference for comparison. NOT PRIVATE; never released.", False),
    Option("ledger", "str", "Budget ledger URL; unset = $PRIVTUNE_LEDGER or ~/.privtune/ledger.db "
           "(the embedded demo keeps its ledger inside the run directory).", "sqlite:///ledger.db"),
    Option("output", "path", "Run directory; unset = a new runs/<timestamp>/.", "runs/my-tuning-run"),
    Option("seed", "int", "Seed for data order, search and noise (experiments only: anyone who knows it can "
           "reproduce the noise; unset = OS entropy, never written to the run's files).", 0, low=0,
           low_inclusive=True),
    Option("feature_cache_dir", "path", "Directory caching backbone features between runs (features of your "
           "private data: keep it as private as the data).", "feature-cache"),
    Option("device", "str", "Where every trial, pilot and the final run train: cpu, cuda, cuda:N or mps; unset = "
           "cuda when available, else cpu.", "cpu"),
    *_UNIT_OPTIONS,
    Option("executor", "choice", "Where the independent trials of random-search, linear-scaling and grid-oracle "
           "run: " + ", ".join(EXECUTORS) + " (local: this process, the default; ray: one Ray task per trial, "
           "`pip install privtune[ray]`).", "local", choices=EXECUTORS),
    Option("ray_address", "str", "With executor: ray, the Ray cluster: auto, local, HOST:PORT or ray://HOST:PORT; "
           "unset = $RAY_ADDRESS, else a `ray start` instance on this machine, else a new local one.", "auto"),
    Option("quiet", "bool", "No progress display (RUN_DIR/log.txt is still written).", False),
]  # `--resume` is a flag only: `privtune tune --resume --config RUN_DIR/config.yaml` continues an interrupted run

SCHEMAS: dict[str, dict[str, Option]] = {
    "train": {o.key: o for o in _TRAIN},
    "tune": {o.key: o for o in _TUNE},
}


# --------------------------------------------------------------------------------------- YAML loading
#: the largest configuration file read (a full template is about 6 kB): anything bigger is refused unread
MAX_CONFIG_BYTES = 256 * 1024
#: how much of a refused value an error message shows
_SHOWN_CHARS = 80


class _Refused(yaml.YAMLError):
    """A YAML construct a configuration file may not use (the message says which, and where)."""


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-5`` (no dot) as a float, as YAML 1.2 does, and refuses what would make
    a file mean something other than it shows: a key given twice (PyYAML keeps the last one silently, which
    once turned `epsilon: 1` into a lifetime budget of 50) and aliases (``*name``: a few lines can expand
    into gigabytes; a configuration has no use for them)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _Refused(f"line {event.start_mark.line + 1} uses the YAML alias *{event.anchor}; aliases are not "
                           "accepted in a configuration file. Write the value out.")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}  # key → the line it was first given on
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: SafeLoader's own error names it
                    break
                if first is not None:  # by presence, not by line: `{epsilon: 1, epsilon: 50}` is one line
                    where = f"twice on line {line}" if first == line else f"twice (lines {first} and {line})"
                    raise _Refused(f"key {_shown(key)} is given {where}. Keep one of them.")
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _shown(value: Any) -> str:
    """``repr(value)``, cut to a length a one-line error can carry."""
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 1] + "…"


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML mapping from ``path``; InvalidParameterError when missing, unreadable or not a mapping."""
    p = Path(path)
    if not p.is_file():
        raise InvalidParameterError(
            f"`config` must be an existing YAML file. Got {str(path)!r}, which "
            f"{'is a directory' if p.is_dir() else 'does not exist'}. "
            "Create one with `privtune config init PATH`."
        )
    size = p.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise InvalidParameterError(
            f"`config` file {str(path)!r} is {size:,} bytes; a configuration file is at most "
            f"{MAX_CONFIG_BYTES // 1024} KiB (a full template is about 6 kB). Pass the configuration file, not a "
            "data file.")
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=_Loader)
    except _Refused as exc:
        raise InvalidParameterError(f"`config` file {str(path)!r}: {exc}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        detail = " ".join(str(exc).split())
        if len(detail) > 300:
            detail = detail[:299] + "…"
        raise InvalidParameterError(f"`config` file {str(path)!r} is not valid YAML: {detail}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InvalidParameterError(
            f"`config` file {str(path)!r} must hold a mapping of option: value. Got a {type(data).__name__}. "
            "Write one `key: value` per line, e.g. `epsilon: 1.0`."
        )
    return data


# --------------------------------------------------------------------------------------- validation
def _check_command(command: Any) -> str:
    if command not in COMMANDS:
        close = difflib.get_close_matches(str(command), COMMANDS, n=1)
        fix = f" Did you mean {close[0]!r}?" if close else ""
        raise InvalidParameterError(f"`command` must be one of {COMMANDS}. Got {command!r}.{fix}")
    return command


def _unknown_key(key: Any, command: str, source: str) -> InvalidParameterError:
    valid = list(SCHEMAS[command])
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    if not close:  # also try with dashes: `learning-rate`
        close = difflib.get_close_matches(str(key).replace("-", "_"), valid, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    other = [c for c in COMMANDS if c != command and key in SCHEMAS[c]]
    also = f" ({key!r} is an option of `privtune {other[0]}`, not of `privtune {command}`.)" if other else ""
    return InvalidParameterError(
        f"{source}: unknown key {_shown(key)} for `privtune {command}`.{hint}{also} "
        f"Valid keys: {', '.join(valid)}."
    )


def _type_error(opt: Option, value: Any, source: str, allowed: str, fix: str = "") -> InvalidParameterError:
    msg = f"{source}: `{opt.key}` must be {allowed}. Got {_shown(value)} ({type(value).__name__})."
    if fix:
        msg += " " + fix
    return InvalidParameterError(msg)


def _interval(opt: Option) -> str:
    lo = "-inf" if opt.low is None else f"{opt.low:g}"
    hi = "inf" if opt.high is None else f"{opt.high:g}"
    lb = "[" if opt.low_inclusive else "("
    rb = ")" if (opt.high is None or opt.high_exclusive) else "]"
    return f"{lb}{lo}, {hi}{rb}"


def _check_range(opt: Option, v: float, raw: Any, source: str, allowed: str) -> None:
    if opt.low is not None and (v < opt.low or (v == opt.low and not opt.low_inclusive)):
        raise _type_error(opt, raw, source, allowed, f"Example: `{opt.key}: {opt.example}`.")
    if opt.high is not None and (v > opt.high or (v == opt.high and opt.high_exclusive)):
        raise _type_error(opt, raw, source, allowed, f"Example: `{opt.key}: {opt.example}`.")


def validate_value(opt: Option, value: Any, source: str = "config") -> Any:
    """Return ``value`` converted to ``opt``'s type, or raise InvalidParameterError naming ``opt.key``."""
    kind = opt.kind
    if kind in ("path", "str"):
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str) or not value.strip():
            raise _type_error(opt, value, source, "a non-empty string" + (" (a path)" if kind == "path" else ""),
                              f"Example: `{opt.key}: {opt.example}`.")
        return value
    if kind == "choice":
        if isinstance(value, str) and value in opt.choices:
            return value
        why = dict(opt.refused).get(value.strip().lower()) if isinstance(value, str) else None
        if why is not None:
            raise InvalidParameterError(f"{source}: `{opt.key}` cannot be {value!r}. {why}")
        close = difflib.get_close_matches(str(value), list(opt.choices), n=1)
        fix = f"Did you mean {close[0]!r}?" if close else ""
        raise _type_error(opt, value, source, "one of " + ", ".join(repr(c) for c in opt.choices), fix)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise _type_error(opt, value, source, "true or false")
    if kind == "str_list":
        items = value.split(",") if isinstance(value, str) else value
        if isinstance(items, (list, tuple)) and items and all(isinstance(v, str) and v.strip() for v in items):
            return [v.strip() for v in items]
        raise _type_error(opt, value, source, "a non-empty list of names (or one comma-separated string)",
                          "Example: `" + opt.key + ": [" + ", ".join(map(str, opt.example)) + "]`.")
    if kind == "label_list":
        items = value.split(",") if isinstance(value, str) else value
        if (isinstance(items, (list, tuple)) and items
                and all((isinstance(v, str) and v.strip()) or (isinstance(v, int) and not isinstance(v, bool))
                        for v in items)):
            return [v.strip() if isinstance(v, str) else str(v) for v in items]
        raise _type_error(opt, value, source, "a non-empty list of class labels (or one comma-separated string)",
                          "Example: `" + opt.key + ": [neg, pos]` or `" + opt.key + ": [0, 1]`.")
    if kind == "mapping":
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            return dict(value)
        example = "".join(f"\n    {k}: {_yaml_scalar(v)}" for k, v in (opt.example or {}).items())
        raise _type_error(opt, value, source, "a mapping of name: value", f"Example:\n  {opt.key}:{example}")
    if kind in ("float", "int", "number"):
        allowed = {"float": "a number", "int": "an integer", "number": "a number"}[kind] + f" in {_interval(opt)}"
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise _type_error(opt, value, source, allowed, f"Example: `{opt.key}: {opt.example}`.")
        fv = float(value)
        if not math.isfinite(fv):
            raise _type_error(opt, value, source, allowed)
        if kind == "int":
            if not fv.is_integer():
                raise _type_error(opt, value, source, allowed, f"Example: `{opt.key}: {opt.example}`.")
            out: Any = int(value)
        elif kind == "number":
            out = int(value) if isinstance(value, numbers.Integral) else fv
        else:
            out = fv
        _check_range(opt, fv, value, source, allowed)
        return out
    raise AssertionError(f"unknown option kind {kind!r}")  # pragma: no cover


def validate_options(command: str, options: Mapping[str, Any], source: str = "config") -> dict[str, Any]:
    """Validate a flat mapping of options for ``command``; ``None`` values are dropped (unset)."""
    _check_command(command)
    schema = SCHEMAS[command]
    out: dict[str, Any] = {}
    for key, value in options.items():
        if not isinstance(key, str) or key not in schema:
            raise _unknown_key(key, command, source)
        if value is None:
            continue
        out[key] = validate_value(schema[key], value, source)
    if "epochs" in out and "steps" in out:
        raise InvalidParameterError(
            f"{source}: give `epochs` or `steps`, not both. Got epochs={out['epochs']!r}, steps={out['steps']!r}. "
            "Remove one of them."
        )
    return out


def _file_options(command: str, data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Flatten a file's mapping for ``command``: top-level keys, then its own section."""
    flat = {k: v for k, v in data.items() if k not in COMMANDS}
    section = data.get(command)
    for name in COMMANDS:
        sec = data.get(name)
        if name in data and sec is not None and not isinstance(sec, Mapping):
            raise InvalidParameterError(
                f"{source}: section `{name}` must be a mapping of option: value. Got {sec!r}."
            )
    if section:
        flat.update(section)
    return validate_options(command, flat, source)


# --------------------------------------------------------------------------------------- public API
def resolve_options(command: str, config_path: str | os.PathLike | None, cli_values: Mapping[str, Any]) -> dict:
    """Merge a YAML configuration file under the command-line flags the user set.

    Args:
        command: ``"train"`` or ``"tune"``: which schema applies.
        config_path: path of a YAML file, or ``None`` for no file.
        cli_values: the flags the user actually gave, keyed by snake_case name (see
            :func:`explicit_cli_values`).  ``None`` values mean "not given" and are ignored;
            a ``"config"`` key is ignored.  Flags win over the file.  Flags that are not
            configuration keys (e.g. ``--json``) are passed through unchanged.

    Returns:
        A new dict holding only the options that were set (file or flags), validated and
        converted (numbers to ``float``/``int``).  Defaults are NOT filled in: they belong
        to :func:`privtune.training.train` / :func:`privtune.hpo.tune`.

    Raises:
        InvalidParameterError: unknown key (naming the closest valid key), wrong type or
            out-of-range value (naming the key and the file), unreadable file.
    """
    _check_command(command)
    merged: dict[str, Any] = {}
    if config_path is not None:
        source = f"config file {os.fspath(config_path)!r}"
        merged.update(_file_options(command, load_yaml(config_path), source))
    flags = {k: v for k, v in dict(cli_values).items() if k != "config" and v is not None}
    schema = SCHEMAS[command]
    # flags outside the schema were already validated by click: pass them through unchanged
    merged.update(validate_options(command, {k: v for k, v in flags.items() if k in schema}, "command line"))
    merged.update({k: v for k, v in flags.items() if k not in schema})
    if "epochs" in merged and "steps" in merged:
        # one came from the file, the other from a flag: the flag wins
        loser = "steps" if "epochs" in flags else "epochs"
        if not ("epochs" in flags and "steps" in flags):
            merged.pop(loser)
    return merged


def explicit_cli_values(ctx: Any) -> dict[str, Any]:
    """The parameters of a click context that the user set on the command line (or by env var).

    Use it in a click command to build ``cli_values`` for :func:`resolve_options`, so that
    click defaults never override the file::

        opts = resolve_options("train", config, explicit_cli_values(click.get_current_context()))
    """
    # Lazy: click only for CLI callers: keeps the config module usable without the CLI.
    import click

    out = {}
    for name, value in ctx.params.items():
        src = ctx.get_parameter_source(name)
        if src in (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT):
            out[name] = value
    out.pop("config", None)
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (str, int, float)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return str(value)


def save_effective_config(options: Mapping[str, Any], run_dir: str | os.PathLike, *,
                          command: str | None = None) -> Path:
    """Write ``RUN_DIR/config.yaml``: the options a run actually used, as YAML.

    ``options`` should be the full effective configuration (the resolved options plus the
    defaults that were applied).  Paths become strings, tuples lists; keys are written in
    the schema's order when ``command`` is given, otherwise sorted.  The file loads back
    with ``--config`` (keys outside the schema are written under a comment and not
    checked here).  Returns the path written.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    data = {str(k): _plain(v) for k, v in options.items() if k != "config"}
    if command is not None:
        _check_command(command)
        order = list(SCHEMAS[command])
        keys = [k for k in order if k in data] + sorted(k for k in data if k not in order)
    else:
        keys = sorted(data)
    ordered = {k: data[k] for k in keys}
    header = "# Effective configuration of this run"
    if command:
        header += f" (privtune {command}); rerun with `privtune {command} --config config.yaml`"
    header += ".\n# Precedence: command-line flags > config file > defaults.\n"
    ledger = ordered.get("ledger")
    # deferred: the ledger package loads SQLAlchemy and the accountant (SciPy), which only a run that writes
    # RUN_DIR/config.yaml has loaded already; reading and checking a configuration file needs neither
    from privtune.ledger import url_without_password

    if isinstance(ledger, str) and url_without_password(ledger) != ledger:
        # the run directory is released: a database password must not travel with it
        ordered["ledger"] = url_without_password(ledger)
        header += ("# ledger: its password is not written; set PGPASSWORD or ~/.pgpass, or pass "
                   "--ledger with the password again.\n")
    body = yaml.safe_dump(ordered, sort_keys=False, allow_unicode=True, default_flow_style=False)
    path = run_dir / "config.yaml"
    path.write_text(header + body, encoding="utf-8")
    return path


def load_effective_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Read ``RUN_DIR/config.yaml`` (empty dict when absent)."""
    p = Path(run_dir) / "config.yaml"
    return load_yaml(p) if p.is_file() else {}


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, float):
        r = repr(value)
        if "e" in r and "." not in r.split("e")[0]:  # 1e-05 -> 1.0e-05 so any YAML reader gets a float
            mant, exp = r.split("e")
            r = f"{mant}.0e{exp}"
        return r
    dumped = yaml.safe_dump(value, default_flow_style=True).strip()
    return dumped.removesuffix("\n...").removesuffix("...").strip()


def template(command: str = "tune") -> str:
    """The commented YAML template that ``privtune config init`` writes for ``command``.

    Every key of the schema appears with its description; the essential ones are set,
    the others are commented out (their defaults come from the Python API).
    """
    _check_command(command)
    lines = [
        f"# privtune {command} configuration.",
        f"# Use it with:  privtune {command} --config THIS_FILE   (flags on the command line override it)",
        "# Keys are the command's flags in snake_case. `null` or a commented-out key = default.",
        "# Check a file with:  privtune config check THIS_FILE",
        "",
    ]
    if command == "tune":
        lines.insert(3, "# Without `data`, tune runs on the embedded SST-2 demo subset with the bundled MiniLM.")
    for opt in SCHEMAS[command].values():
        lines.append(f"# {opt.help}")
        if opt.kind == "mapping":
            body = [f"{opt.key}:"] + [f"  {k}: {_yaml_scalar(v)}" for k, v in opt.example.items()]
        else:
            body = [f"{opt.key}: {_yaml_scalar(opt.example)}"]
        prefix = "" if opt.active else "# "
        lines.extend(prefix + b for b in body)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def check_config_file(path: str | os.PathLike, command: str | None = None) -> dict[str, dict[str, Any]]:
    """Validate a configuration file; returns ``{command: options}`` for each command checked.

    With ``command=None`` the file must be valid for ``train`` or for ``tune`` (sections
    are checked against their own command); the error of the closest fit is raised.
    """
    data = load_yaml(path)
    source = f"config file {os.fspath(path)!r}"
    if command is not None:
        _check_command(command)
        return {command: _file_options(command, data, source)}
    sections = [c for c in COMMANDS if c in data]
    candidates = sections or list(COMMANDS)
    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, InvalidParameterError] = {}
    for c in candidates:
        try:
            results[c] = _file_options(c, data, source)
        except InvalidParameterError as exc:
            errors[c] = exc
    if sections and errors:  # every section present must be valid
        raise next(iter(errors.values()))
    if not results:
        # neither fits: report the error of the command with fewer unknown keys
        def misfit(c: str) -> tuple[int, int]:
            unknown = [str(k) for k in data if k not in SCHEMAS[c] and k not in COMMANDS]
            near = sum(1 for k in unknown if difflib.get_close_matches(k.replace("-", "_"), list(SCHEMAS[c]), n=1))
            return (len(unknown), -near)

        best = min(candidates, key=misfit)
        raise errors[best]
    return results


__all__ = [
    "SCHEMAS",
    "Option",
    "resolve_options",
    "explicit_cli_values",
    "save_effective_config",
    "load_effective_config",
    "load_yaml",
    "validate_options",
    "template",
    "check_config_file",
]
