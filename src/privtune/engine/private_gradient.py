"""The one DP step: per-example clipping in a single backward pass, noise once per logical batch.

Usage (one logical batch made of one or more physical micro-batches)::

    pg = PrivateGradient(model, max_grad_norm=1.0, noise_multiplier=1.1, expected_batch_size=256)
    for micro_batch in logical_batch:                       # any number, including zero
        losses = loss_fn(model(**micro_batch), labels, reduction="none")   # shape (B,)
        norms = pg.backward(losses)                          # accumulates Σ_i c_i ∇loss_i
    info = pg.release()                                      # + N(0, σ²C²), / expected batch size
    optimizer.step(); optimizer.zero_grad()

The per-example loss vector must be *sum-decomposable*: ``losses[i]`` may depend on example
``i`` only (no batch-mean normaliser, no in-batch contrastive term, no train-mode BatchNorm).
A per-example loss that is itself a mean over that example's tokens is fine.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import types
import warnings
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_map

from privtune._validation import check_choice, check_int, check_real
from privtune.choices import CLIPPINGS
from privtune.errors import InvalidParameterError, UnsupportedModuleError
from privtune.engine._layers import (
    ConvHandler,
    EmbeddingHandler,
    FallbackHandler,
    GroupNormHandler,
    Handler,
    LayerNormHandler,
    LinearHandler,
    Record,
    _MaterialisingHandler,
    hf_conv1d_type,
)
from privtune.engine._vision_layers import has_own_forward, vision_handler
from privtune.engine._rmsnorm import RMSNormHandler, is_rmsnorm
from privtune.engine._tied import tied_pair, tied_sq_norms
from privtune.engine.mechanisms import privatise_sum
from privtune.engine.step import MicroBatch, ReleaseInfo

__all__ = ["PrivateGradient", "ReleaseInfo"]


def _in_backward() -> bool:
    try:
        return torch._C._current_graph_task_id() != -1
    except AttributeError:  # pragma: no cover - older torch
        return False


def _is_batchnorm(m: nn.Module) -> bool:
    return isinstance(m, nn.modules.batchnorm._BatchNorm)


def _plain(module: nn.Module, base: type) -> bool:
    """``module`` is a ``base`` whose forward is ``base``'s own (so ``base``'s per-example rule holds)."""
    return isinstance(module, base) and not has_own_forward(module, base)


def _batchnorm_error(name: str) -> UnsupportedModuleError:
    return UnsupportedModuleError(
        f"`model` contains BatchNorm module {name!r} in train mode (or without running statistics). Such "
        "BatchNorm mixes examples through batch statistics, so per-example gradients (and DP) are undefined. "
        "Fix: replace it with "
        "GroupNorm (e.g. nn.GroupNorm(min(32, C), C)), or put it in eval mode and freeze it "
        "(module.eval(); module.requires_grad_(False)) before building PrivateGradient and after every model.train()."
    )


def clip_factors(norms: torch.Tensor, C: float, clipping: str, gamma: float) -> torch.Tensor:
    """Per-example scale factors bounding each clipped term's norm by C: the one clip-factor rule of privtune.

    ``clipping="flat"`` (Abadi): ``min(1, C/‖g_i‖)``; ``"automatic"`` (AUTO-S, Bu et al.): ``C/(‖g_i‖ + γ)``.
    Both give sensitivity ≤ C.  ``norms`` (B,) are per-example gradient norms in the units of C.
    """
    if clipping == "flat":  # a zero norm gets factor 1 (C/tiny clamps to 1, also when it overflows to inf)
        return (C / norms.clamp_min(torch.finfo(norms.dtype).tiny)).clamp(max=1.0)
    return C / (norms + gamma)


def zero_rows(t: Any, keep: torch.Tensor) -> Any:
    """``t`` with the rows (dimension 0) where ``keep`` is False set to exactly 0, when ``t`` is a floating
    tensor with one row per example; anything else unchanged.  ``torch.where``, not a product: a NaN or inf
    row times 0 would stay NaN."""
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0 and t.shape[0] == keep.shape[0]:
        mask = keep.to(t.device).reshape(-1, *([1] * (t.dim() - 1)))
        return torch.where(mask, t, torch.zeros((), dtype=t.dtype, device=t.device))
    return t


def finite_terms(losses: torch.Tensor | None, norms: torch.Tensor) -> torch.Tensor:
    """(B,) bool: the examples whose loss (when given) and gradient norm are finite.  The others get clip
    factor 0 (their term is dropped): one non-finite row must neither make the release NaN nor stop the run
    after its budget was reserved (either would reveal that the row was sampled)."""
    ok = torch.isfinite(norms)
    if losses is not None:
        ok = ok & torch.isfinite(losses.detach()).to(ok.device)
    return ok


def per_example_gradients(losses: torch.Tensor, params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    """(B, d) matrix of flattened per-example gradients by a plain loop (slow; small samples). NOT PRIVATE.

    ``losses`` is the (B,) per-example loss vector of a forward pass; ``params`` the trainable parameters.
    Call it inside ``PrivateGradient.paused()`` or on a model without a PrivateGradient attached.
    """
    if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
        raise InvalidParameterError("`losses` must be a (B,) tensor of per-example losses. Got something else. Use reduction='none'.")
    params = list(params)
    rows = []
    for i in range(losses.shape[0]):
        gs = torch.autograd.grad(losses[i], params, retain_graph=True, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(gs, params)]))
    return torch.stack(rows)


class _BucketTableHandler(_MaterialisingHandler):
    """A small embedding table looked up many times per example (MPNet's relative-position bias: 32 buckets ×
    heads, T² lookups per example): per-example gradients (B, rows, dim) by one scatter-add.  The ghost norm of
    EmbeddingHandler would compare all T² × T² pairs of ids per example instead."""

    kind = "embedding (per-example table)"

    def per_example(self, records):
        w = self.params["weight"]
        pad = self.module.padding_idx
        out = None
        for r in records:
            ids = r.act.reshape(r.act.shape[0], -1)
            g = r.grads[0].reshape(ids.shape[0], ids.shape[1], -1)
            if pad is not None:
                g = g * (ids != pad).unsqueeze(-1).to(g.dtype)
            pe = torch.zeros(ids.shape[0], *w.shape, dtype=g.dtype, device=g.device)
            pe.scatter_add_(1, ids.unsqueeze(-1).expand(-1, -1, g.shape[-1]), g)
            out = pe if out is None else out + pe
        return {w: out}


def _mpnet_bias_encoders(model: nn.Module) -> list[nn.Module]:
    """The MPNet encoders of ``model`` whose relative-position bias table is trainable.

    MPNet looks the table up once per forward pass with (T, T) bucket ids, without the batch dimension, and
    broadcasts the result over the batch, so autograd holds only the batch's summed gradient for it (a
    per-example rule would see a wrong "batch" of T rows).  :func:`_per_example_position_bias` replaces that
    lookup while the step is attached."""
    return [m for m in model.modules()
            if type(m).__name__ == "MPNetEncoder" and isinstance(getattr(m, "relative_attention_bias", None), nn.Embedding)
            and m.relative_attention_bias.weight.requires_grad and hasattr(m, "relative_position_bucket")]


def _per_example_position_bias(encoder: nn.Module, x: torch.Tensor, position_ids: torch.Tensor | None = None,
                               num_buckets: int = 32) -> torch.Tensor:
    """MPNet's ``compute_position_bias`` with the bucket ids expanded to (B, T, T) before the lookup: the same
    values (B, heads, T, T), but each example has its own output gradient for the table.  Bound to the encoder
    as a method (``types.MethodType``), so that a deep copy of the model binds it to the copy."""
    bsz, qlen = x.size(0), x.size(1)
    pos = position_ids if position_ids is not None else \
        torch.arange(qlen, dtype=torch.long, device=x.device).expand(bsz, qlen)
    relative_position = pos[:, None, :] - pos[:, :, None]  # memory position − context position
    bucket = encoder.relative_position_bucket(relative_position, num_buckets=num_buckets)
    return encoder.relative_attention_bias(bucket).permute(0, 3, 1, 2).contiguous()


class PrivateGradient:
    """Clipped, noised gradient of a sum of per-example losses (the DP-SGD step, Abadi et al. 2016).

    Args:
        model: the ``nn.Module`` being trained. Its trainable parameters are those with
            ``requires_grad=True`` at construction; hooks are attached to the modules owning them.
        max_grad_norm: clipping norm C > 0 (L2, over all trainable parameters together: flat clipping).
        noise_multiplier: σ ≥ 0, the noise standard deviation *divided by C*; the clipped sum
            receives N(0, σ²C²) per coordinate once per logical batch. σ = 0 gives no privacy
            (allowed for non-private references, which must be labelled as such).
        expected_batch_size: the public normaliser q·N (> 0): the released gradient is
            (clipped sum + noise) / expected_batch_size, never divided by the realised size.
        clipping: ``"flat"`` (Abadi: c_i = min(1, C/‖g_i‖)) or ``"automatic"`` (AUTO-S,
            Bu et al.: c_i = C / (‖g_i‖ + γ)). Both bound each clipped term by C.
        gamma: AUTO-S stability constant γ > 0 (0.01 in the papers).
        per_layer: clip each module's part of the per-example gradient separately, to
            C/√K for K modules with trainable parameters (layer-wise thresholds as in fastDP),
            instead of the whole gradient to C. Each clipped term still has norm ≤ C, so the
            noise N(0, σ²C²) and the accounting are unchanged. Default False (flat: one norm).
        seed: integer seed of the noise generator for reproducible experiments (recorded as
            ``self.seed``; put it in the certificate). ``None`` (default) seeds from the OS
            (``secrets``); that seed is never stored or exposed, only the generator state in
            :meth:`state_dict` (keep checkpoints private).
        process_group: a :class:`privtune.engine.distributed.ProcessGroup` for data-parallel training
            (``None``: one process).  Each rank accumulates the clipped gradients of its own examples;
            :meth:`release` all-reduces the sums and adds the noise once (on rank 0), so every rank gets the
            same released gradient; ``expected_batch_size`` is the global q·N.

    Layers handled without materialising per-example gradients (book-keeping, one backward):
    ``nn.Linear`` (2-D and N-D inputs; ghost T×T or per-example form chosen per layer by cost
    2T² vs p·d), HF ``Conv1D``, ``nn.Embedding`` (ghost, padding_idx respected), ``nn.Conv1d/2d``
    (unfold; depthwise and grouped too; timm's TF-"same" padded ``Conv2dSame``), ``nn.LayerNorm``,
    ``nn.GroupNorm``, RMSNorm (``nn.RMSNorm``, HF ``LlamaRMSNorm``), eval-mode BatchNorm (also timm's
    ``BatchNormAct2d``); bias-only layers keep no activation (DP-BiTFiT).  A weight tied between an
    ``nn.Embedding`` and an ``nn.Linear`` LM head (GPT-2, SmolLM2) is one parameter with one per-example
    gradient, the sum of both uses; its norm adds a ghost cross term (engine/_tied.py), so no vocabulary-sized
    per-example gradient is formed.  Any other module owning a trainable parameter (and
    ``nn.MultiheadAttention`` as a whole, and a subclass of these layers that overrides ``forward``) uses a
    ``torch.func``
    per-example fallback, announced by one warning.  MPNet's relative-position bias table gets per-example
    gradients of its buckets × heads entries (the lookup batched while the step is attached).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_grad_norm: float,
        noise_multiplier: float,
        expected_batch_size: float,
        clipping: str = "flat",
        gamma: float = 0.01,
        per_layer: bool = False,
        seed: int | None = None,
        process_group: Any = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise InvalidParameterError(
                f"`model` must be a torch.nn.Module. Got {type(model).__name__}. Pass the model you will call in the forward pass."
            )
        self.max_grad_norm = check_real(max_grad_norm, "max_grad_norm", low=0.0,
                                        fix="Pass the per-example clipping norm C, e.g. max_grad_norm=1.0.")
        self.noise_multiplier = check_real(noise_multiplier, "noise_multiplier", low=0.0, low_inclusive=True,
                                           fix="σ is the noise std divided by C; calibrate it with privtune.calibrate_noise_multiplier.")
        self.expected_batch_size = check_real(expected_batch_size, "expected_batch_size", low=0.0,
                                              fix="Pass q·N, the expected (not realised) logical batch size, e.g. 256.")
        self.clipping = check_choice(clipping, "clipping", CLIPPINGS)
        self.gamma = check_real(gamma, "gamma", low=0.0, fix="AUTO-S uses gamma=0.01.")
        if not isinstance(per_layer, bool):
            raise InvalidParameterError(f"`per_layer` must be True or False. Got {per_layer!r}.")
        self.per_layer = per_layer
        if seed is not None:
            seed = check_int(seed, "seed", low=0, high=2**63 - 1, fix="Pass a non-negative integer or None (OS entropy).")
        self.seed: int | None = seed
        self.process_group = process_group
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(seed if seed is not None else secrets.randbits(63))

        self.model = model
        self._params, self._param_names = self._trainable_parameters(model)
        self._batchnorms = [(n, m) for n, m in model.named_modules() if _is_batchnorm(m)]
        self._check_batchnorm()
        self._mpnet_encoders = _mpnet_bias_encoders(model)
        self._bucket_tables = {id(m.relative_attention_bias) for m in self._mpnet_encoders}
        self.handlers, self.fallback_modules, self._owner_name = self._build_handlers(model)
        if self.fallback_modules:
            warnings.warn(
                "PrivateGradient: no fast per-example rule for these modules; using the slower torch.func "
                "per-example fallback (exact, B× parameter memory): " + ", ".join(self.fallback_modules),
                UserWarning,
                stacklevel=2,
            )

        for m in self._mpnet_encoders:  # an instance attribute; close() removes it
            m.compute_position_bias = types.MethodType(_per_example_position_bias, m)
        self._hooks: list[Any] = []
        self._batch: int | None = None
        self._suspended = False
        self._edges: list[Any] = []
        self._hooks.append(model.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        for h in self.handlers:
            self._hooks.append(h.module.register_forward_hook(self._make_forward_hook(h), with_kwargs=True))
            if h.capture_module is not None:  # runs inside h.module's forward, before the hook above
                self._hooks.append(h.capture_module.register_forward_pre_hook(self._make_capture_hook(h)))
        self._reset_accumulators()
        self._releases = 0
        self._last_layer_norms: torch.Tensor | None = None

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _trainable_parameters(model: nn.Module) -> tuple[list[nn.Parameter], dict[nn.Parameter, str]]:
        """The parameters with requires_grad (each once, in model order) and their qualified names."""
        params: list[nn.Parameter] = []
        names: dict[nn.Parameter, str] = {}
        for name, p in model.named_parameters():
            if p.requires_grad and p not in names:
                params.append(p)
                names[p] = name
        if not params:
            raise InvalidParameterError(
                "`model` must have at least one parameter with requires_grad=True. Got none. "
                "Choose what to train first (e.g. privtune.finetune.apply_mode(model, 'bitfit'))."
            )
        return params, names

    def _build_handlers(self, model: nn.Module) -> tuple[list[Handler], list[str], dict[nn.Parameter, str]]:
        """One handler per module that owns trainable parameters (``nn.MultiheadAttention`` as a whole).

        Returns the handlers, the descriptions of the modules that use the per-example fallback, and each
        trainable parameter's owning module name.  A weight tied between an ``nn.Embedding`` and an
        ``nn.Linear`` LM head is one parameter with one per-example gradient, the sum of both uses (recorded in
        ``self._ties``; engine/_tied.py); any other tied trainable weight is refused.
        """
        handlers: list[Handler] = []
        fallback_modules: list[str] = []
        owner: dict[nn.Parameter, str] = {}
        handler_of: dict[nn.Parameter, Handler] = {}
        tied: set[nn.Parameter] = set()
        self._ties: list[tuple[Handler, Handler]] = []
        self._handler_name: dict[int, str] = {}  # the module each handler hooks (a tied weight has two)
        covered: set[int] = set()
        for mname, module in model.named_modules():
            if id(module) in covered:
                continue
            if isinstance(module, nn.MultiheadAttention):
                own = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
                for sub in module.modules():
                    covered.add(id(sub))
            else:
                own = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            if mname.endswith("relative_attention_bias") and id(module) not in self._bucket_tables:
                raise UnsupportedModuleError(
                    f"`model` has a trainable relative-position bias table {mname!r} ({type(model).__name__}) that "
                    "is looked up without the batch dimension and broadcast over the batch, so its per-example "
                    "gradients cannot be separated (MPNet's is supported). Fix: freeze it (requires_grad_(False)).")
            handler = self._make_handler(module, dict(own))
            self._handler_name[id(handler)] = mname or "<model>"
            for n, p in own:
                # one embedding + one head only: a third use would need more cross terms
                tie = tied_pair(handler_of[p], handler, p) if p in handler_of and p not in tied else None
                if p in owner and (tie is None or self.per_layer):
                    raise UnsupportedModuleError(
                        f"`model` parameter {self._param_names[p]!r} is shared by modules {owner[p]!r} and "
                        f"{mname!r} (tied weights). Per-example clipping supports a weight tied between an "
                        "nn.Embedding and an nn.Linear LM head only, and not with per_layer=True. "
                        "Fix: freeze it (requires_grad_(False)), untie the weights, or use per_layer=False."
                    )
                if tie is not None:
                    self._ties.append(tie)
                    tied.add(p)
                    continue
                owner[p] = mname or "<model>"
                handler_of[p] = handler
            if isinstance(handler, FallbackHandler):
                fallback_modules.append(f"{mname or '<model>'} ({type(module).__name__})")
            handlers.append(handler)
        return handlers, fallback_modules, owner

    def _make_handler(self, module: nn.Module, own: dict[str, nn.Parameter]) -> Handler:
        roles = set(own)
        special = vision_handler(module, own)  # eval-mode BatchNorm, timm's TF-"same" convolutions
        if special is not None:
            return special
        if _plain(module, nn.Linear) and roles <= {"weight", "bias"}:
            return LinearHandler(module, own)
        conv1d = hf_conv1d_type()
        if conv1d is not None and isinstance(module, conv1d) and roles <= {"weight", "bias"}:
            return LinearHandler(module, own, transposed=True)
        if (_plain(module, nn.Conv1d) or _plain(module, nn.Conv2d)) and roles <= {"weight", "bias"}:
            return ConvHandler(module, own)
        if id(module) in self._bucket_tables:
            return _BucketTableHandler(module, own)
        if isinstance(module, nn.Embedding) and roles == {"weight"}:
            if module.scale_grad_by_freq:
                raise UnsupportedModuleError(
                    "`model` has an nn.Embedding with scale_grad_by_freq=True, which rescales gradients by "
                    "in-batch token counts (couples examples). Fix: construct it with scale_grad_by_freq=False."
                )
            if module.max_norm is not None:
                raise UnsupportedModuleError(
                    "`model` has an nn.Embedding with max_norm set (renormalises rows in place during forward). "
                    "Fix: set max_norm=None or freeze the embedding."
                )
            return EmbeddingHandler(module, own)
        if _plain(module, nn.LayerNorm) and roles <= {"weight", "bias"}:
            return LayerNormHandler(module, own)
        if _plain(module, nn.GroupNorm) and roles <= {"weight", "bias"}:
            return GroupNormHandler(module, own)
        if roles == {"weight"} and is_rmsnorm(module):
            return RMSNormHandler(module, own)
        # anything else, including subclasses whose forward computes something else than their base class
        # (timm's LayerNorm2d, StdConv2d, GroupNormAct, ...): the exact per-example fallback
        names = {p: n for n, p in own.items()}
        return FallbackHandler(module, {n: p for n, p in own.items()}, names)

    def _check_batchnorm(self) -> None:
        for name, m in self._batchnorms:
            # without running statistics, BatchNorm normalises by batch statistics in eval mode too
            if m.training or m.running_mean is None or m.running_var is None:
                raise _batchnorm_error(name)

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, module, args, kwargs):
        if self._suspended:
            return None
        self._check_batchnorm()
        # a new forward pass: records of a previous forward that never reached backward are stale
        for h in self.handlers:
            if h.records:
                h.clear()
            h.pending = None
        self._edges = []
        self._batch = None
        for v in tree_flatten((args, kwargs))[0]:  # first tensor argument (also inside dicts/lists)
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                self._batch = int(v.shape[0])
                break
        return None

    def _make_forward_hook(self, handler: Handler):
        def hook(module, args, kwargs, output):
            if self._suspended or not torch.is_grad_enabled():
                return None
            if _in_backward():
                raise UnsupportedModuleError(
                    f"module {self._owner_of(handler)!r} ran its forward pass during backward (activation / gradient "
                    "checkpointing). PrivateGradient needs each trainable layer's forward to run once, before "
                    "backward. Fix: disable checkpointing (model.gradient_checkpointing_disable())."
                )
            B = self._batch
            if isinstance(handler, FallbackHandler):
                leaves = tree_flatten(output)[0]
                idx = [
                    j for j, t in enumerate(leaves)
                    if isinstance(t, torch.Tensor) and t.requires_grad and t.dim() > 0 and (B is None or t.shape[0] == B)
                ]
                if not idx:
                    return None
                rec = Record(act=handler.store_input(args, kwargs), grads=[None] * len(idx), n_outputs=len(idx), leaf_index=idx)
                for k, j in enumerate(idx):
                    self._capture(handler, rec, k, leaves[j])
                handler.records.append(rec)
                return None
            if not isinstance(output, torch.Tensor) or not output.requires_grad:
                return None
            new_output = None
            act_args = args
            if B is not None and B > 1 and output.dim() > 0 and output.shape[0] == 1 and isinstance(handler, EmbeddingHandler):
                # e.g. HF position embeddings looked up with (1, T) position_ids and broadcast over the
                # batch: expand so each example gets its own output gradient
                new_output = output.expand(B, *output.shape[1:])
                ids = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
                act_args, kwargs = (ids.expand(B, *ids.shape[1:]),), {}
                output = new_output
            if output.dim() == 0 or (B is not None and output.shape[0] != B):
                raise UnsupportedModuleError(
                    f"module {self._owner_of(handler)!r} ({type(module).__name__}) produced an output of shape "
                    f"{tuple(output.shape)} whose first dimension is not the batch size {B}; per-example gradients "
                    "need the batch on dimension 0 of every trainable layer's input and output. "
                    "Fix: keep the batch dimension first, or freeze this module."
                )
            if handler.capture_module is not None:  # the gradient was captured inside the module's forward
                rec, handler.pending = handler.pending, None
                if rec is None:
                    return None
                rec.act = handler.store_input(act_args, kwargs)
                handler.records.append(rec)
                return None
            rec = Record(act=handler.store_input(act_args, kwargs), grads=[None])
            self._capture(handler, rec, 0, output)
            handler.records.append(rec)
            return new_output

        return hook

    def _make_capture_hook(self, handler: Handler):
        """Forward pre-hook of ``handler.capture_module``: capture the gradient of its input (before any in-place
        operation that follows changes that tensor) in a record that ``handler``'s forward hook completes."""
        def hook(module, args):
            if self._suspended or not torch.is_grad_enabled():
                return None
            t = args[0] if args else None
            if isinstance(t, torch.Tensor) and t.requires_grad and t.dim() > 0:
                rec = Record(grads=[None])
                self._capture(handler, rec, 0, t)
                handler.pending = rec
            return None

        return hook

    def _capture(self, handler: Handler, rec: Record, k: int, t: torch.Tensor) -> None:
        def on_grad(g):
            if isinstance(handler, FallbackHandler):
                rec.grads[k] = g
            else:
                handler.receive_grad(rec, k, g)
            return None

        t.register_hook(on_grad)
        self._edges.append(get_gradient_edge(t))

    def _owner_of(self, handler: Handler) -> str:
        name = self._handler_name.get(id(handler))
        if name is not None:
            return name
        p = next(iter(handler.params.values()))
        return self._owner_name.get(p, "?")

    # ------------------------------------------------------------------ public API
    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the clipped sum to adding or removing one example: C."""
        return self.max_grad_norm

    @property
    def last_layer_norms(self) -> torch.Tensor | None:
        """(B, K) per-module gradient L2 norms of the last :meth:`backward` (K = all modules with trainable
        parameters, 0 for a module the micro-batch did not reach), or None unless ``per_layer=True``.
        These are what per-layer clipping compares with C/√K. **NOT PRIVATE** (diagnostics only)."""
        return self._last_layer_norms

    @property
    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters this step privatises (requires_grad at construction), in model order."""
        return list(self._params)

    def accumulate_batch(self, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The :class:`~privtune.engine.step.DPStep` form of :meth:`backward`: ``batch.losses()`` forwards the
        rows through the model (hooks record the activations) and returns their per-example losses; their
        clipped gradients are added.  Returns the (B,) losses and (B,) per-example gradient norms (NOT PRIVATE)."""
        losses = batch.losses()
        return losses, self.backward(losses, row_weights=batch.row_weights)

    def example_gradients(self, batch: MicroBatch) -> torch.Tensor:
        """(B, P) per-example gradients of the trainable parameters on ``batch``, engine paused: no clipping,
        no noise, nothing accumulated (NOT PRIVATE: clipping diagnostics only)."""
        with self.paused():
            return per_example_gradients(batch.losses(), self._params)

    def backward(self, losses: torch.Tensor, row_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Back-propagate per-example losses once and add their clipped gradients to the running sum.

        Args:
            losses: shape (B,), ``losses[i]`` the loss of example i of the micro-batch that was just
                forwarded through ``model`` (``reduction="none"``). Must be sum-decomposable (see module doc).
                An example whose loss or gradient norm is NaN or infinite gets clip factor 0: its term adds
                exactly nothing (counted in :attr:`ReleaseInfo.nonfinite_examples`, NOT PRIVATE), so the run
                neither stops nor releases NaN because of one row.
            row_weights: optional (B,) non-negative weights multiplying the clip factors (user-level DP:
                1/m_u for a row of a unit with m_u rows in the step, :meth:`privtune.engine.units.UnitIndex.row_weights`,
                so each unit adds the mean of its clipped gradients, norm ≤ C).  None: weight 1.

        Returns:
            Detached (B,) tensor of per-example gradient L2 norms (before clipping). **NOT PRIVATE.**
        """
        self._check_losses(losses)
        B = losses.shape[0]
        if B == 0:
            for h in self.handlers:
                h.clear()
            self._edges = []
            return losses.detach()
        self._check_losses_have_grad(losses, B)
        gram_cache: dict = {}
        pack_cache: dict = {}  # packed layer inputs shared by the backward hooks (Q, K, V)
        for h in self.handlers:
            h.gram_cache, h.pack_cache = gram_cache, pack_cache
        try:
            self._backpropagate(losses)
        finally:
            pack_cache.clear()
        if not any(g is not None for h in self.handlers for r in h.records for g in r.grads):
            for h in self.handlers:
                h.clear()
            raise InvalidParameterError(
                "`losses` must come from the most recent forward pass of `model` (one forward, then backward). "
                "Got losses that reach none of the recorded trainable layers. Run backward right after the forward "
                "pass that produced them, and evaluate inside `with pg.paused():` or torch.no_grad()."
            )
        try:
            # norms are certified upper bounds accumulated in float64 (engine/_layers.py); they are returned
            # in the parameters' precision as before
            out_dtype = torch.float64 if self._params[0].dtype == torch.float64 else torch.float32
            sq, active = self._squared_norms(B, losses.device)
            norms = sq.clamp_min(0).sqrt()
            ok = finite_terms(losses, norms)
            if not bool(ok.all()):
                self._drop_terms(active, ok)
            clipped = self._accumulate_clipped(norms, active, out_dtype, ok, row_weights)
        finally:
            gram_cache.clear()
            for h in self.handlers:
                h.clear()
        self._count += B
        self._nonfinite += int((~ok).sum())
        self._clipped += int(clipped.sum())
        self._microbatches += 1
        return norms.detach().to(out_dtype)

    @staticmethod
    def _check_losses(losses: torch.Tensor) -> None:
        """Refuse anything but a 1-D tensor of per-example losses (before looking at its size)."""
        if not isinstance(losses, torch.Tensor):
            raise InvalidParameterError(
                f"`losses` must be a torch.Tensor of shape (B,). Got {type(losses).__name__}. "
                "Compute the loss with reduction='none'."
            )
        if losses.dim() != 1:
            raise InvalidParameterError(
                f"`losses` must be a 1-D per-example loss vector of shape (B,). Got shape {tuple(losses.shape)}. "
                "Use reduction='none' (and average over tokens within each example if needed)."
            )

    def _check_losses_have_grad(self, losses: torch.Tensor, B: int) -> None:
        """Refuse a non-empty loss vector that cannot be back-propagated to the forward just recorded."""
        if not losses.requires_grad:
            raise InvalidParameterError(
                "`losses` must require grad (come from a forward pass of `model` with grad enabled). Got a tensor "
                "without grad. Do not wrap the forward pass in torch.no_grad()."
            )
        if self._batch is not None and B != self._batch:
            raise InvalidParameterError(
                f"`losses` must have one entry per example of the forwarded batch ({self._batch}). Got {B}. "
                "Do not reduce or reshape the per-example loss."
            )

    def _backpropagate(self, losses: torch.Tensor) -> None:
        """One autograd pass of Σ_i losses[i] to the recorded layer outputs (the hooks capture their gradients).

        The parameters of modules that were never called are added as guard inputs: a gradient reaching them
        means a weight used functionally elsewhere, whose per-example part cannot be attributed, so it is refused.
        Their ``.grad`` is restored afterwards.
        """
        fired = {id(h) for h in self.handlers if h.records}
        used = {p for h in self.handlers if id(h) in fired for p in h.params.values()}  # tied: one use fired
        guard = [p for h in self.handlers if id(h) not in fired for p in h.params.values() if p not in used]
        saved = {p: p.grad for p in guard}
        for p in guard:
            p.grad = None
        edges, self._edges = self._edges, []
        try:
            torch.autograd.backward(losses.sum(), inputs=edges + guard)
            leaked = [self._param_names[p] for p in guard if p.grad is not None and bool(p.grad.ne(0).any())]
        finally:
            for p in guard:
                p.grad = saved[p]
        if leaked:
            for h in self.handlers:
                h.clear()
            raise UnsupportedModuleError(
                f"`model` trainable parameters {leaked} received gradient although their owning module was never "
                "called (used functionally elsewhere, e.g. tied or functional weights); their per-example gradients "
                "cannot be attributed. Fix: freeze them, or call the module that owns them."
            )

    def _squared_norms(self, B: int, device: torch.device) -> tuple[torch.Tensor, list[Handler]]:
        """Finish every handler the loss reached; return the (B,) float64 squared per-example gradient norms
        (summed over those handlers, units of C²) and the list of those handlers."""
        sq = torch.zeros(B, dtype=torch.float64, device=device)
        active: list[Handler] = []
        tied = {id(h) for pair in self._ties for h in pair}
        for h in self.handlers:
            recs = [r for r in h.records if any(g is not None for g in r.grads)]
            for r in recs:
                self._check_record_grads(h, r, B)
            if not recs:
                continue
            h.records = recs
            self._finish_handler(h)
            if id(h) not in tied:
                sq = sq + h.sq.to(sq.dtype)
            active.append(h)
        reached = {id(h) for h in active}
        for emb, lin in self._ties:  # one norm for the tied weight: both uses plus their cross term
            if id(emb) in reached or id(lin) in reached:
                sq = sq + tied_sq_norms(emb if id(emb) in reached else None, lin if id(lin) in reached else None)
        return sq, active

    def _check_record_grads(self, h: Handler, rec: Record, B: int) -> None:
        """Refuse a record whose output gradients are incomplete or not one row per example."""
        for g in rec.grads:
            if g is None:  # an output of a fallback module that did not reach the loss
                raise UnsupportedModuleError(
                    f"module {self._owner_of(h)!r}: only some of its outputs reach the loss; the "
                    "per-example fallback needs all of them. Fix: freeze this module."
                )
            if g.shape[0] != B:
                raise InvalidParameterError(
                    f"`losses` has {B} entries but module {self._owner_of(h)!r} saw a batch of "
                    f"{g.shape[0]}. Pass exactly one loss per example of the forwarded batch."
                )

    def _finish_handler(self, h: Handler) -> None:
        """Compute ``h``'s per-example squared norms with the forward hooks suspended (the fallback re-runs the
        module's forward)."""
        was_suspended, self._suspended = self._suspended, True
        try:
            h.finish()
        except RuntimeError as exc:
            if isinstance(h, FallbackHandler) and "random" in str(exc).lower():
                raise UnsupportedModuleError(
                    f"module {self._owner_of(h)!r} ({type(h.module).__name__}) uses randomness (e.g. active "
                    "dropout) inside the per-example fallback, which recomputes its forward pass. "
                    "Fix: set its dropout probability to 0, or call module.eval() on it."
                ) from exc
            raise
        finally:
            self._suspended = was_suspended

    @staticmethod
    def _drop_terms(active: list[Handler], ok: torch.Tensor) -> None:
        """Zero every stored per-example quantity (inputs, output gradients, materialised per-example
        gradients) of the examples where ``ok`` is False, so that their clip factor 0 gives exactly 0."""
        for h in active:
            for r in h.records:
                r.act = tree_map(lambda t: zero_rows(t, ok), r.act)
                r.grads = [zero_rows(g, ok) for g in r.grads]
            for attr in ("_pe", "_bias_pe"):  # the handlers' per-example caches (_layers.py)
                cached = getattr(h, attr, None)
                if isinstance(cached, dict):
                    setattr(h, attr, {p: zero_rows(t, ok) for p, t in cached.items()})
                elif isinstance(cached, torch.Tensor):
                    setattr(h, attr, zero_rows(cached, ok))

    def _accumulate_clipped(self, norms: torch.Tensor, active: list[Handler], out_dtype: torch.dtype,
                            ok: torch.Tensor | None = None, row_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Add Σ_i c_i g_i of the ``active`` handlers to the running sum; return the (B,) bool mask of examples
        whose norm exceeded the threshold (C, or C/√K per module with ``per_layer``).

        ``norms`` are the (B,) per-example gradient norms in the units of C; ``ok`` (B,) bool, optional: the
        examples whose term is kept (the others get clip factor 0, :func:`finite_terms`); ``row_weights`` (B,),
        optional: multiply the clip factors (see :meth:`backward`).
        """
        C = self.max_grad_norm
        if self.per_layer:  # one threshold C/√K per module: Σ_k (C/√K)² = C², sensitivity stays C
            C_layer = C / math.sqrt(len(self.handlers))
            layer_norms = [h.sq.to(norms.dtype).clamp_min(0).sqrt() for h in active]
            layer_factors = [self._clip_factors(n, C_layer) for n in layer_norms]
            if ok is not None:
                layer_factors = [torch.where(ok.to(f.device), f, torch.zeros_like(f)) for f in layer_factors]
            clipped = torch.stack([n > C_layer for n in layer_norms]).any(0) if active else norms > C
            table = torch.zeros(norms.shape[0], len(self.handlers), dtype=out_dtype, device=norms.device)
            pos = {id(h): k for k, h in enumerate(self.handlers)}
            for h, n in zip(active, layer_norms):
                table[:, pos[id(h)]] = n.to(out_dtype)
            self._last_layer_norms = table.detach()
        else:
            factors = self._clip_factors(norms, C)
            if ok is not None:
                factors = torch.where(ok.to(factors.device), factors, torch.zeros_like(factors))
            layer_factors = [factors] * len(active)
            clipped = norms > C
        if row_weights is not None:
            layer_factors = [f * row_weights.to(device=f.device, dtype=f.dtype) for f in layer_factors]
        for h, factors in zip(active, layer_factors):
            for p, t in h.clipped_sum(h.records, factors).items():
                t = t.to(p.dtype)
                if p in self._sum:
                    self._sum[p].add_(t)
                else:
                    self._sum[p] = t
        return clipped

    def _clip_factors(self, norms: torch.Tensor, C: float) -> torch.Tensor:
        """Per-example scale factors bounding each clipped term's norm by C (:func:`clip_factors`)."""
        return clip_factors(norms, C, self.clipping, self.gamma)

    def release(self) -> ReleaseInfo:
        """Privatise the accumulated clipped sum and write it to ``param.grad``; start a new logical batch.

        For every trainable parameter: ``grad = (Σ_i c_i ∇loss_i + N(0, σ²C² I)) / expected_batch_size``.
        Called once per logical batch (also for an empty Poisson batch: then the gradient is noise only).
        Overwrites any existing ``param.grad``.
        """
        std = self.noise_multiplier * self.max_grad_norm
        sums = []
        for p in self._params:
            s = self._sum.get(p)
            if s is None or s.dtype != p.dtype or s.shape != p.shape:
                s = torch.zeros_like(p) if s is None else s.to(p.dtype).reshape(p.shape).clone()
            elif not s.is_contiguous():
                s = s.contiguous()
            sums.append(s)
        released = privatise_sum(sums, self.noise_multiplier, self.max_grad_norm, self.expected_batch_size,
                                 self._generator, self.process_group).value
        for p, g in zip(self._params, released):
            p.grad = g.detach()
        self._releases += 1
        info = ReleaseInfo(
            step=self._releases,
            batch_size=self._count,
            clipped_fraction=(self._clipped / self._count) if self._count else 0.0,
            microbatches=self._microbatches,
            noise_std=std / self.expected_batch_size,
            sensitivity=self.max_grad_norm,
            expected_batch_size=self.expected_batch_size,
            nonfinite_examples=self._nonfinite,
        )
        self._reset_accumulators()
        return info

    def _reset_accumulators(self) -> None:
        self._sum: dict[nn.Parameter, torch.Tensor] = {}
        self._count = 0
        self._clipped = 0
        self._nonfinite = 0
        self._microbatches = 0

    @property
    def pending_examples(self) -> int:
        """Examples accumulated since the last release (NOT PRIVATE)."""
        return self._count

    def state_dict(self) -> dict:
        """Noise-generator state and configuration, for exact resume. Keep it private (it fixes future noise)."""
        if self._microbatches:
            raise InvalidParameterError(
                f"`state_dict` must be taken between logical batches. Got {self._microbatches} accumulated "
                "micro-batches not yet released. Call release() first."
            )
        return {
            "format": 1,
            "seed": self.seed,
            "generator_state": self._generator.get_state(),
            "releases": self._releases,
            "max_grad_norm": self.max_grad_norm,
            "noise_multiplier": self.noise_multiplier,
            "expected_batch_size": self.expected_batch_size,
            "clipping": self.clipping,
            "gamma": self.gamma,
            "per_layer": self.per_layer,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved; the next noise draw continues the saved stream bit for bit."""
        if not isinstance(state, dict) or "generator_state" not in state:
            raise InvalidParameterError(
                "`state` must be a dict from PrivateGradient.state_dict(). Got "
                f"{type(state).__name__} without 'generator_state'. Pass the saved engine state."
            )
        for key in ("max_grad_norm", "noise_multiplier", "expected_batch_size", "clipping", "gamma", "per_layer"):
            if key in state and state[key] != getattr(self, key):
                raise InvalidParameterError(
                    f"`state` was saved with {key}={state[key]!r} but this PrivateGradient has "
                    f"{key}={getattr(self, key)!r}. Resume with the same privacy configuration."
                )
        self._generator.set_state(state["generator_state"])
        self._releases = int(state.get("releases", 0))
        self.seed = state.get("seed")
        self._reset_accumulators()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Context in which forward passes are not recorded (e.g. evaluation with grad enabled)."""
        old = self._suspended
        self._suspended = True
        try:
            yield
        finally:
            self._suspended = old

    def close(self) -> None:
        """Remove every hook from the model. The object cannot be used afterwards."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for m in self._mpnet_encoders:
            m.__dict__.pop("compute_position_bias", None)
        for h in self.handlers:
            h.clear()

    def __enter__(self) -> "PrivateGradient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> dict:
        """How each trainable module is handled (for logs and reports)."""
        out: dict[str, str] = {}
        for h in self.handlers:
            mode = h.kind
            if h.kind in ("linear", "conv", "layernorm", "groupnorm", "batchnorm") and not h.needs_input:
                mode += " (bias only, no activations)"
            out[self._owner_of(h)] = mode
        return out

