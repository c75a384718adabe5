"""Last-layer fine-tuning on cached features of a frozen backbone.

The backbone is frozen and (for the privacy argument) public, so its features can be computed once
and reused by every step, trial and run: :func:`cache_features` returns a :class:`FeatureSet`
(an (N, d) float32 tensor and labels).  :func:`privtune.training.fit` accepts a ``FeatureSet`` as
training data and then trains only the classification head on it, with the same DP step (clipping,
noise once per logical batch, division by the expected batch size) as every other mode, at hundreds
of thousands of example-gradients per second; the single full-batch step of Mehta et al. (large-scale transfer) is
``fit(model, features, noise=NoiseSpec(σ, sample_rate=1.0, steps=1), optimizer=OptimizerSpec("adam", ...))`` from the zero head that
``apply_mode(model, "last-layer")`` sets up.

Feature caching computes the features of private examples without noise; nothing derived from them
leaves the process except through the DP head training.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from privtune._validation import check_choice, check_int, check_real
from privtune.engine.private_gradient import (
    CLIPPINGS,
    ReleaseInfo,
    clip_factors,
    finite_terms,
    zero_rows,
)
from privtune.engine.mechanisms import privatise_sum
from privtune.engine.step import MicroBatch
from privtune.errors import DataError, InvalidParameterError
from privtune.models.classifier import length_order


@dataclass
class FeatureSet:
    """Cached backbone features: ``features`` (N, d) float32, ``labels`` (N,) int64 or None."""

    features: torch.Tensor
    labels: torch.Tensor | None
    num_labels: int
    label_names: list[str] | None = None
    source: str | None = None
    kind: str = "features"

    def __post_init__(self) -> None:
        if self.features.dim() != 2:
            raise DataError(f"`features` must be a 2-D (N, d) tensor; got shape {tuple(self.features.shape)}.")
        if self.labels is not None and self.labels.shape[0] != self.features.shape[0]:
            raise DataError(
                f"`labels` has {self.labels.shape[0]} rows but `features` has {self.features.shape[0]}."
            )

    def __len__(self) -> int:
        return int(self.features.shape[0])

    @property
    def has_labels(self) -> bool:
        return self.labels is not None

    @property
    def num_features(self) -> int:
        return int(self.features.shape[1])

    def row_sq_norms(self) -> torch.Tensor:
        """‖x_i‖² of every row, (N,), computed once and cached (the features are never modified in place)."""
        cached = self.__dict__.get("_row_sq_norms")
        if cached is None or cached.shape[0] != self.features.shape[0]:
            cached = self.__dict__["_row_sq_norms"] = self.features.pow(2).sum(1)
        return cached

    def subset(self, indices: Iterable[int] | torch.Tensor) -> "FeatureSet":
        idx = torch.as_tensor(list(indices) if not isinstance(indices, torch.Tensor) else indices, dtype=torch.long)
        return FeatureSet(self.features[idx], None if self.labels is None else self.labels[idx],
                          self.num_labels, self.label_names, None)

    def canonical_rows(self) -> Iterable[bytes]:
        """Content for fingerprinting (features and labels as raw bytes)."""
        yield self.features.contiguous().numpy().tobytes()
        if self.labels is not None:
            yield self.labels.contiguous().numpy().tobytes()


def _cache_key(model: Any, dataset: Any) -> str:
    h = hashlib.sha256()
    h.update(str(getattr(model, "source", "")).encode())
    h.update(f"|{model.pooling}|{model.normalize}|{model.max_length}|".encode())
    features = (getattr(model.backbone, "vision_config", None) or {}).get("features", "final")
    if features != "final":  # a vision backbone's stage features (absent for "final", whose keys stay as they are)
        h.update(f"features={features}|".encode())
    to_dict = getattr(getattr(model, "processor", None), "to_dict", None)
    if to_dict is not None:  # image preprocessing (resolution, normalisation) changes the features too
        h.update(repr(sorted(to_dict().items())).encode())
    # the backbone weights themselves (cheap relative to a forward pass over the data)
    for name, p in sorted(model.backbone.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().cpu().numpy().tobytes()[:4096])
        h.update(str(tuple(p.shape)).encode())
    center = getattr(model, "feature_center", None)
    if center is not None:  # features centred and re-normalised by the model itself
        h.update(center.detach().float().cpu().numpy().tobytes())
    for row in dataset.canonical_rows():
        h.update(row)
    return h.hexdigest()


def cache_features(
    model: Any,
    dataset: Any,
    *,
    batch_size: int = 64,
    cache_dir: str | os.PathLike | None = None,
    progress: Callable[[int], None] | None = None,
) -> FeatureSet:
    """Compute the head-input features of every example once (backbone frozen, eval mode).

    Parameters
    ----------
    model : Classifier
        The (frozen) backbone and pooling; only its features are used.
    dataset : TextDataset or ImageDataset
    batch_size : int, default 64
        Examples per forward pass.  Texts are tokenized once, identical texts embedded once, and batched in
        order of token count, each batch padded to its own longest text (the attention mask keeps padding out
        of the features: the same features as one padded batch, up to float rounding).
    cache_dir : path, optional
        If given, features are stored in ``cache_dir/<sha256>.pt`` keyed by the backbone, the pooling
        and the data, and loaded from there on the next call.
    progress : callable, optional
        Called with the number of examples done after each batch.

    Returns
    -------
    FeatureSet
        ``features`` of shape (N, model.num_features), float32.
    """
    batch_size = check_int(batch_size, "batch_size", low=1)
    if len(dataset) == 0:
        raise DataError("Cannot cache features of an empty dataset.")
    if not hasattr(model, "features"):
        raise InvalidParameterError(f"`model` must be a privtune Classifier; got {type(model).__name__}.")
    path = None
    if cache_dir is not None:
        key = _cache_key(model, dataset)
        path = Path(cache_dir) / f"{key}.pt"
        if path.is_file():
            blob = torch.load(path, weights_only=True)
            fs = FeatureSet(blob["features"], blob.get("labels"), int(blob["num_labels"]),
                            getattr(dataset, "label_names", None), getattr(dataset, "source", None))
            if progress is not None:
                progress(len(fs))
            return fs
    was_training = model.training
    model.eval()
    try:
        # allocated outside inference mode: a normal tensor (the head's training saves it for backward)
        feats = torch.empty(len(dataset), model.num_features, dtype=torch.float32)
        threads = torch.get_num_threads()
        if model.device.type == "cpu":
            torch.set_num_threads(caching_threads())
        try:
            with torch.inference_mode():
                _compute_features(model, dataset, batch_size, progress, feats)
        finally:
            torch.set_num_threads(threads)
    finally:
        model.train(was_training)
    labels = None
    if getattr(dataset, "labels", None) is not None:
        labels = torch.tensor(dataset.labels, dtype=torch.long)
    num_labels = int(getattr(dataset, "num_labels", None) or model.num_labels)
    fs = FeatureSet(feats, labels, num_labels, getattr(dataset, "label_names", None), getattr(dataset, "source", None))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"features": feats, "labels": labels, "num_labels": num_labels}, tmp)
        os.replace(tmp, path)
    return fs


def caching_threads() -> int:
    """Intra-op threads for feature caching on the CPU: torch's setting, lowered to the cores that are idle (the
    cores this process may use minus the 1-minute load average, at least 1).

    On an oversubscribed machine the threads of one parallel region wait for each other at its end, and one of them
    is often descheduled: on 2 cores at load 5–9, one thread embedded MiniLM features about 4× faster per CPU second
    (and faster in wall time) than two (bench/feature_cache.py).  The features are the same up to float rounding."""
    current = torch.get_num_threads()
    try:
        cores = len(os.sched_getaffinity(0))
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # platforms without them: keep torch's setting
        return current
    return max(1, min(current, int(cores - load + 0.5)))


def _compute_features(model: Any, dataset: Any, batch_size: int, progress: Callable[[int], None] | None,
                      feats: torch.Tensor) -> None:
    """Write the features of every row into ``feats`` (N, num_features), in the dataset's order."""
    if getattr(dataset, "kind", None) != "text" or getattr(model, "kind", None) != "text":
        order = length_order(dataset)
        for s in range(0, len(order), batch_size):
            idx = order[s : s + batch_size]
            feats[idx] = model.features(**model.encode(dataset, idx)).float().cpu()
            if progress is not None:
                progress(len(idx))
        return
    rows_of: dict[str, list[int]] = {}
    for i, text in enumerate(dataset.texts):
        rows_of.setdefault(text, []).append(i)
    texts = list(rows_of)
    enc = dict(model.tokenizer(texts, truncation=True, max_length=model.max_length))
    lengths = [len(ids) for ids in enc["input_ids"]]
    enc["attention_mask"] = [[1] * n for n in lengths]  # always: padding must never enter the features
    fields = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
    order = sorted(range(len(texts)), key=lengths.__getitem__)
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        out = model.features(**_padded(model.tokenizer, enc, fields, idx, lengths[idx[-1]])).float().cpu()
        for j, u in enumerate(idx):
            feats[rows_of[texts[u]]] = out[j]
        if progress is not None:
            progress(sum(len(rows_of[texts[u]]) for u in idx))


def _padded(tokenizer: Any, enc: Any, fields: list[str], idx: list[int], width: int) -> dict[str, torch.Tensor]:
    """Rows ``idx`` of a batch tokenization without padding, padded to ``width`` tokens on the tokenizer's
    padding side (pad id, attention mask 0, token type 0), as ``tokenizer(..., padding=True)`` would."""
    fill = {"input_ids": tokenizer.pad_token_id, "attention_mask": 0,
            "token_type_ids": getattr(tokenizer, "pad_token_type_id", 0)}
    left = getattr(tokenizer, "padding_side", "right") == "left"
    out = {}
    for k in fields:
        t = torch.full((len(idx), width), int(fill[k]), dtype=torch.long)
        for r, i in enumerate(idx):
            row = enc[k][i]
            if left:
                t[r, width - len(row):] = torch.tensor(row, dtype=torch.long)
            else:
                t[r, :len(row)] = torch.tensor(row, dtype=torch.long)
        out[k] = t
    return out


def check_finite_features(data: Any, what: str) -> None:
    """Refuse a :class:`FeatureSet` with a NaN or infinite value (other data: nothing to check; texts and
    image files give finite inputs).

    Called before anything is reserved or trained.  The message gives the number of such rows, never a
    row's values; like every refusal that reads the private data, whether it happens is outside ε
    (docs/privacy-model.md, "Refusals that read the private data")."""
    if getattr(data, "kind", None) != "features" or not isinstance(getattr(data, "features", None), torch.Tensor):
        return
    feats = data.features
    if not feats.is_floating_point() or bool(torch.isfinite(feats).all()):
        return
    bad = int((~torch.isfinite(feats)).any(dim=1).sum())
    raise DataError(
        f"`{what}` has {bad} feature row(s) with NaN or infinite values. Features must be finite: drop or "
        "recompute those rows (e.g. cache the features in float32 from a model that does not overflow) before "
        "training.")


class LinearHeadGradient:
    """The DP step of :class:`privtune.engine.PrivateGradient`, specialised to one ``nn.Linear`` head
    on cached features, with per-example gradients in closed form.

    Implements :class:`privtune.engine.step.DPStep`, as PrivateGradient does (the DP step of the one training
    loop, :class:`privtune.training._Loop`): accumulate clipped per-example terms per micro-batch
    (:meth:`accumulate_batch`; :meth:`accumulate` takes the tensors directly),
    :meth:`release` noise once per logical batch (returns a :class:`~privtune.engine.ReleaseInfo`),
    :meth:`state_dict` / :meth:`load_state_dict`, :meth:`paused`, :meth:`close`.  The clip factors are
    :func:`privtune.engine.private_gradient.clip_factors` and the noise is added by
    :func:`privtune.engine.mechanisms.privatise_sum`, the same functions PrivateGradient uses.

    For ``logits = x Wᵀ + b`` and softmax cross-entropy, example i has ``∂ℓ/∂W = (p_i − e_{y_i}) x_iᵀ`` and
    ``∂ℓ/∂b = p_i − e_{y_i}``, so ``‖g_i‖ = ‖p_i − e_{y_i}‖ · sqrt(‖x_i‖² + 1)`` (without the 1 when the head
    has no bias) and the clipped sum is one matrix product ``(c ⊙ (P − E))ᵀ X``.  Everything else is
    the engine's semantics exactly: flat (Abadi) or automatic (AUTO-S) clipping factors, noise
    N(0, σ²C²) per coordinate added once per logical batch to the clipped sum, division by the
    expected batch size q·N, and the same noise generator and draw order (weight, then bias), so a
    run with a fixed seed releases the same gradients as ``PrivateGradient`` (up to float rounding).
    """

    def __init__(self, head: torch.nn.Linear, *, max_grad_norm: float, noise_multiplier: float,
                 expected_batch_size: float, clipping: str = "flat", gamma: float = 0.01,
                 seed: int | None = None, process_group: Any = None) -> None:
        if not isinstance(head, torch.nn.Linear):
            raise InvalidParameterError(f"`head` must be an nn.Linear. Got {type(head).__name__}.")
        self.head = head
        self.max_grad_norm = check_real(max_grad_norm, "max_grad_norm", low=0.0)
        self.noise_multiplier = check_real(noise_multiplier, "noise_multiplier", low=0.0, low_inclusive=True)
        self.expected_batch_size = check_real(expected_batch_size, "expected_batch_size", low=0.0)
        self.clipping = check_choice(clipping, "clipping", CLIPPINGS)
        self.gamma = check_real(gamma, "gamma", low=0.0)
        self.seed = seed
        self.process_group = process_group  # data-parallel: all-reduce, noise once (PrivateGradient's semantics)
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(seed if seed is not None else secrets.randbits(63))
        self._params = [p for p in head.parameters() if p.requires_grad]
        if not self._params:
            raise InvalidParameterError("`head` has no parameter with requires_grad=True.")
        self._releases = 0
        self._last_norms: torch.Tensor | None = None
        self._reset()

    def _reset(self) -> None:
        self._sum_w: torch.Tensor | None = None
        self._sum_b: torch.Tensor | None = None
        self._count = 0
        self._clipped = 0
        self._nonfinite = 0
        self._microbatches = 0

    @property
    def pending_examples(self) -> int:
        """Examples accumulated since the last release (NOT PRIVATE)."""
        return self._count

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """For symmetry with PrivateGradient: forward passes never reach this step (nothing to pause)."""
        yield

    @torch.no_grad()
    def accumulate(self, features: torch.Tensor, labels: torch.Tensor,
                   sq_norms: torch.Tensor | None = None,
                   row_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the clipped per-example gradients of a micro-batch; returns (losses, norms), both (B,).

        ``sq_norms`` (B,), optional: the rows' ‖x_i‖², when the caller has them cached (the training loop
        computes them once per feature set).  ``row_weights`` (B,), optional: multiply the clip factors (user
        level: 1/m_u, :meth:`privtune.engine.units.UnitIndex.row_weights`).  Both returned vectors are computed from private data without
        noise (NOT PRIVATE)."""
        W, b = self.head.weight, self.head.bias
        logits = features @ W.T
        if b is not None:
            logits = logits + b
        logp = torch.log_softmax(logits, dim=1)
        losses = -logp.gather(1, labels[:, None]).squeeze(1)
        resid = logp.exp()
        resid[torch.arange(labels.numel(), device=labels.device), labels] -= 1.0  # P − E
        train_w = W.requires_grad
        train_b = b is not None and b.requires_grad
        if not train_w:
            xsq = torch.zeros_like(losses)
        else:
            xsq = sq_norms.to(features.dtype) if sq_norms is not None else (features * features).sum(1)
        norms = resid.norm(dim=1) * torch.sqrt(xsq + (1.0 if train_b else 0.0))
        factors = clip_factors(norms, self.max_grad_norm, self.clipping, self.gamma)
        # a row with a NaN/inf loss or norm gets clip factor 0 and adds exactly nothing (torch.where: NaN·0 is
        # NaN), as in PrivateGradient: the release stays finite and the sensitivity C.  A NaN/inf feature
        # always shows here: it makes ‖x_i‖² (hence the norm) non-finite, or, without a trained weight, the loss
        if row_weights is not None:
            factors = factors * row_weights.to(device=factors.device, dtype=factors.dtype)
        ok = finite_terms(losses, norms)
        if not bool(ok.all()):
            factors = torch.where(ok, factors, torch.zeros_like(factors))
            resid, features = zero_rows(resid, ok), zero_rows(features, ok)
            self._nonfinite += int((~ok).sum())
        scaled = resid * factors[:, None]
        if train_w:
            sw = scaled.T @ features
            self._sum_w = sw if self._sum_w is None else self._sum_w + sw
        if train_b:
            sb = scaled.sum(0)
            self._sum_b = sb if self._sum_b is None else self._sum_b + sb
        self._count += labels.numel()
        self._clipped += int((norms > self.max_grad_norm).sum())
        self._microbatches += 1
        self._last_norms = norms[:, None]
        return losses, norms

    @property
    def last_layer_norms(self) -> torch.Tensor | None:
        """(B, 1) norms of the last accumulated micro-batch: one ``nn.Linear`` head is one layer, so per-layer
        clipping (C/√1 = C) is flat clipping here.  **NOT PRIVATE** (diagnostics only)."""
        return self._last_norms

    def accumulate_batch(self, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The :class:`~privtune.engine.step.DPStep` form of :meth:`accumulate`: reads the batch's cached
        features (no forward pass of a model)."""
        if batch.features is None:
            raise InvalidParameterError("LinearHeadGradient trains a head on cached features; this micro-batch "
                                        "has none. Train the model with PrivateGradient instead.")
        features, sq_norms = batch.features()
        return self.accumulate(features, batch.labels, sq_norms=sq_norms, row_weights=batch.row_weights)

    @torch.no_grad()
    def example_gradients(self, batch: MicroBatch) -> torch.Tensor:
        """(B, P) per-example gradients of the head on ``batch`` in closed form, ``(p_i − e_{y_i}) x_iᵀ`` then
        ``p_i − e_{y_i}`` for a trained bias; no clipping, noise or accumulation (NOT PRIVATE: diagnostics)."""
        features, _ = batch.features()
        resid = torch.softmax(self.head(features), 1)
        resid[torch.arange(batch.labels.numel(), device=batch.labels.device), batch.labels] -= 1.0
        parts = []
        if self.head.weight.requires_grad:
            parts.append((resid[:, :, None] * features[:, None, :]).flatten(1))
        if self.head.bias is not None and self.head.bias.requires_grad:
            parts.append(resid)
        return torch.cat(parts, 1)

    @torch.no_grad()
    def release(self) -> ReleaseInfo:
        """Write (clipped sum + N(0, σ²C²)) / expected_batch_size to ``param.grad`` (once per logical batch)."""
        std = self.noise_multiplier * self.max_grad_norm
        sums = []
        for p in self._params:
            s = self._sum_w if p is self.head.weight else self._sum_b
            sums.append(torch.zeros_like(p) if s is None else s.to(p.dtype))
        released = privatise_sum(sums, self.noise_multiplier, self.max_grad_norm, self.expected_batch_size,
                                 self._generator, self.process_group).value
        for p, g in zip(self._params, released):
            p.grad = g.detach()
        self._releases += 1
        info = ReleaseInfo(step=self._releases, batch_size=self._count,
                           clipped_fraction=(self._clipped / self._count) if self._count else 0.0,
                           microbatches=self._microbatches, noise_std=std / self.expected_batch_size,
                           sensitivity=self.max_grad_norm, expected_batch_size=self.expected_batch_size,
                           nonfinite_examples=self._nonfinite)
        self._reset()
        return info

    def state_dict(self) -> dict:
        return {"format": 1, "seed": self.seed, "generator_state": self._generator.get_state(),
                "releases": self._releases, "max_grad_norm": self.max_grad_norm,
                "noise_multiplier": self.noise_multiplier, "expected_batch_size": self.expected_batch_size,
                "clipping": self.clipping, "gamma": self.gamma}

    def load_state_dict(self, state: dict) -> None:
        for key in ("max_grad_norm", "noise_multiplier", "expected_batch_size", "clipping", "gamma"):
            if key in state and state[key] != getattr(self, key):
                raise InvalidParameterError(
                    f"`state` was saved with {key}={state[key]!r} but this step has {key}={getattr(self, key)!r}."
                )
        self._generator.set_state(state["generator_state"])
        self._releases = int(state.get("releases", 0))
        self.seed = state.get("seed")
        self._reset()

    def close(self) -> None:
        """Nothing to remove (no hooks); for symmetry with PrivateGradient."""
