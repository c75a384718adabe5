"""The two per-example rules for depthwise convolutions on a CPU, on the bundled EfficientNet-Lite0: the loop over
kernel offsets (or output positions) on views of the input, and one weight-gradient call of the convolution
library per example, which the engine uses for float32 3 × 3 layers with at least 256 output positions.

Two tables per resolution, both CPU time on ``--threads`` torch threads, Fashion-MNIST training images (random
pixels without the Debian package), batch ``--batch-size``, a randomly initialised head (so that every layer's
gradient is non-zero):

* per depthwise layer: milliseconds of each rule on the layer's stored input and output gradient from one engine
  backward pass (median of ``--passes``), which rule the engine picks, and the largest difference between the
  two results relative to the largest entry (float32 rounding);
* the whole DP step (forward, engine backward, a release every 4 micro-batches) with the engine's choice and with
  the loop on every depthwise layer, alternated in one process with a non-private step on the same batches (its
  weight gradients summed by autograd): milliseconds per step (median of ``--steps``) and the median over steps
  of non-private ÷ DP time.  Alternating in one process keeps a shared machine's drift out of the comparison.

Usage: ``python bench/depthwise_rules.py [--sizes 64,128] [--threads 1] [--out
bench/results/engine/depthwise-rules.json]`` (from the repository root; it runs ``src/`` first on the path).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))


def _cpu_ms(f, passes: int) -> float:
    """Median CPU milliseconds of ``passes`` calls of ``f`` after one warm-up call."""
    f()
    runs = []
    for _ in range(passes):
        start = time.process_time()
        f()
        runs.append((time.process_time() - start) * 1e3)
    return statistics.median(runs)


def measure(image_size: int, batch_size: int, passes: int, steps: int) -> dict:
    import torch
    import torch.nn.functional as F

    import privtune.engine._vision_layers as rules
    from engine import _fashion_pixels
    from privtune.engine import PrivateGradient
    from privtune.finetune import apply_mode
    from privtune.models import load_classifier

    torch.manual_seed(0)
    clf = load_classifier("efficientnet-lite0", num_labels=10, image_size=image_size, seed=0)
    apply_mode(clf, "full", zero_init_head=False)
    clf.train()  # BatchNorm stays in eval mode
    x, y, origin = _fashion_pixels(4 * batch_size, image_size, clf.processor)
    batches = [(x[k:k + batch_size], y[k:k + batch_size]) for k in range(0, 4 * batch_size, batch_size)]
    pg = PrivateGradient(clf, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4 * batch_size, seed=0)

    captured = []
    per_example = rules.GroupedConvHandler.per_example

    def capture(self, records):
        captured.extend((self, r.act, r.grads[0]) for r in records)
        return per_example(self, records)

    rules.GroupedConvHandler.per_example = capture
    try:
        pg.backward(F.cross_entropy(clf(pixel_values=batches[0][0]), batches[0][1], reduction="none"))
    finally:
        rules.GroupedConvHandler.per_example = per_example
    pg.release()
    layers = []
    for handler, act, grad in captured:
        m = handler.module
        loop = handler._by_windows(act, grad)
        calls = handler._by_example_calls(act, grad)
        layers.append({
            "channels": m.in_channels, "input": list(act.shape[-2:]), "output": list(grad.shape[-2:]),
            "kernel": list(m.kernel_size), "stride": list(m.stride), "tf_same_padding": handler.same_pad,
            "engine_uses": "library calls" if handler._by_library(act, grad) else "loop",
            "loop_ms": _cpu_ms(lambda: handler._by_windows(act, grad), passes),
            "library_calls_ms": _cpu_ms(lambda: handler._by_example_calls(act, grad), passes),
            "max_difference_relative": float((calls - loop).abs().max() / loop.abs().max().clamp_min(1e-30))})
        row = layers[-1]
        print(f"  {row['channels']:>5} ch {row['input'][0]:>3} px {row['kernel'][0]}x{row['kernel'][1]} "
              f"/{row['stride'][0]}: loop {row['loop_ms']:7.2f} ms, library calls {row['library_calls_ms']:7.2f} ms"
              f" (engine: {row['engine_uses']})", flush=True)
    captured.clear()  # the stored activations are not needed for the step timings

    params = [p for p in clf.parameters() if p.requires_grad]

    def dp_step(i: int) -> None:
        xb, yb = batches[i % 4]
        pg.backward(F.cross_entropy(clf(pixel_values=xb), yb, reduction="none"))
        if i % 4 == 3:
            pg.release()

    def nondp_step(i: int) -> None:
        xb, yb = batches[i % 4]
        with pg.paused():
            (F.cross_entropy(clf(pixel_values=xb), yb, reduction="sum") / batch_size).backward()
        for p in params:
            p.grad = None

    kernel_area = rules._LIBRARY_KERNEL_AREA
    variants = {"engine's choice": kernel_area, "loop on every layer": 0}
    times: dict[str, list[float]] = {name: [] for name in (*variants, "non-private")}
    try:
        for name, area in variants.items():  # warm-up
            rules._LIBRARY_KERNEL_AREA = area
            dp_step(0)
        nondp_step(0)
        for i in range(steps):
            order = list(times) if i % 2 == 0 else list(reversed(times))
            for name in order:
                start = time.process_time()
                if name == "non-private":
                    nondp_step(i)
                else:
                    rules._LIBRARY_KERNEL_AREA = variants[name]
                    dp_step(i)
                times[name].append((time.process_time() - start) * 1e3)
    finally:
        rules._LIBRARY_KERNEL_AREA = kernel_area
    pg.close()
    step = {name: {"ms_per_step": statistics.median(t), "runs_ms": t} for name, t in times.items()}
    for name in variants:
        step[name]["non_private_over_dp"] = statistics.median(
            n / d for n, d in zip(times["non-private"], times[name]))
    print("  step: " + ", ".join(f"{k} {v['ms_per_step']:.0f} ms" for k, v in step.items()) + "; non-private ÷ DP: "
          + ", ".join(f"{k} {step[k]['non_private_over_dp']:.3f}" for k in variants), flush=True)
    return {"image_size": image_size, "data": origin, "layers": layers, "step": step}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,128", help="input resolutions in pixels, comma-separated")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--batch-size", type=int, default=32, help="examples per micro-batch")
    ap.add_argument("--passes", type=int, default=5, help="timed calls per rule and layer (after one warm-up)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per variant (after one warm-up each)")
    ap.add_argument("--out", default=None, help="write the tables as JSON here")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    started = time.time()
    tables = []
    for size in (int(s) for s in args.sizes.split(",")):
        print(f"{size} px, batch {args.batch_size}, {args.threads} thread(s)", flush=True)
        tables.append(measure(size, args.batch_size, args.passes, args.steps))
    result = {"command": "python bench/depthwise_rules.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
              "minutes": round((time.time() - started) / 60, 1),
              "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__, "torch_threads": args.threads,
                          "load_average_end": os.getloadavg()},
              "setup": {"model": "EfficientNet-Lite0 (bundled), full fine-tuning, random head, 10 classes",
                        "batch_size": args.batch_size, "passes": args.passes, "steps": args.steps,
                        "clock": "process CPU time", "statistic": "median"},
              "tables": tables}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
