"""Host time of image preprocessing: privtune's ImagePreprocessor on the embedded Fashion-MNIST images as stored
(greyscale: one channel resized, three written) against the same images as RGB copies (three channels resized),
CPU milliseconds per image on one torch thread, the median of several passes over the same images.

On a GPU the loop preprocesses every step's images on the host between kernels, so this time is part of each
step there (docs/engine.md). Both paths give the same pixels bit for bit (tests/test_models_vision.py).

Usage: ``python bench/image_preprocessing.py [--sizes 64,128] [--passes 5]
[--out bench/results/engine/image-preprocessing.json]`` (from the repository root; it runs ``src/`` first on the
path).
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


def ms_per_image(preprocessor, images: list, batch: int, passes: int) -> list[float]:
    """CPU milliseconds per image of each pass over ``images`` in batches of ``batch`` (the loop's micro-batch)."""
    out = []
    for _ in range(passes):
        start = time.process_time()
        for k in range(0, len(images), batch):
            preprocessor(images[k:k + batch])
        out.append((time.process_time() - start) / len(images) * 1e3)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,128", help="input resolutions in pixels, comma-separated")
    ap.add_argument("--passes", type=int, default=5, help="timed passes over the images per path (after one warm-up)")
    ap.add_argument("--batch", type=int, default=256, help="images per call (a micro-batch of the loop)")
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    args = ap.parse_args(argv)

    import torch

    from privtune.data.datasets import embedded_fashion_mnist
    from privtune.models.vision import ImagePreprocessor

    torch.set_num_threads(1)
    train, _, _ = embedded_fashion_mnist()
    grey = [train.load_image(i, keep_greyscale=True) for i in range(len(train))]
    rgb = [im.convert("RGB") for im in grey]
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        prep = ImagePreprocessor(size)
        if not torch.equal(prep(grey[:8])["pixel_values"], prep(rgb[:8])["pixel_values"]):
            raise SystemExit("the greyscale and RGB paths disagree: fix privtune before timing them")
        timed = {}
        for name, images in (("rgb", rgb), ("greyscale", grey)):
            ms_per_image(prep, images[:args.batch], args.batch, 1)  # warm-up
            runs = ms_per_image(prep, images, args.batch, args.passes)
            timed[name] = {"ms_per_image": statistics.median(runs), "runs": runs}
        rows.append({"image_size": size, "images": len(grey), **{f"{k}_ms_per_image": v["ms_per_image"]
                                                                 for k, v in timed.items()},
                     "rgb_over_greyscale": timed["rgb"]["ms_per_image"] / timed["greyscale"]["ms_per_image"],
                     "runs": {k: v["runs"] for k, v in timed.items()}})
        print(f"{size} px: RGB copies {timed['rgb']['ms_per_image']:.3f} ms/image, as stored (greyscale) "
              f"{timed['greyscale']['ms_per_image']:.3f} ms/image ({rows[-1]['rgb_over_greyscale']:.2f}x)",
              flush=True)
    result = {"command": "python bench/image_preprocessing.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__, "torch_threads": 1, "load_average_end": os.getloadavg()},
              "setup": {"data": "the embedded Fashion-MNIST training images (28 px greyscale)", "batch": args.batch,
                        "passes": args.passes, "clock": "process CPU time", "statistic": "median over passes"},
              "table": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
