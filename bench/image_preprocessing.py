"""Host time of image preprocessing: privtune's ImagePreprocessor on the embedded Fashion-MNIST images as stored
(greyscale: one channel resized, three written) against the same images as RGB copies (three channels resized),
CPU milliseconds per image on one torch thread, the median of several passes over the same images.

On a GPU the loop preprocesses every step's images on the host between kernels, so this time is part of each
step there (docs/engine.md). Both paths give the same pixels bit for bit (tests/test_models_vision.py).

``--threads 1,2``: a second table times what the loop calls, ``Classifier.encode`` (rows of the dataset → pixel
tensor: each image read and resized on the host's threads, then converted in one call), in wall-clock
milliseconds per image with torch's thread count (which sets the host threads) at each value given.

Usage: ``python bench/image_preprocessing.py [--sizes 64,128] [--passes 5] [--threads 1,2]
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
    ap.add_argument("--threads", default=None,
                    help="also time Classifier.encode at these torch thread counts, comma-separated (e.g. 1,2)")
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
    threads = _encode_table(train, args) if args.threads else None
    result = {"command": "python bench/image_preprocessing.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__, "torch_threads": 1, "load_average_end": os.getloadavg()},
              "setup": {"data": "the embedded Fashion-MNIST training images (28 px greyscale)", "batch": args.batch,
                        "passes": args.passes, "clock": "process CPU time", "statistic": "median over passes"},
              "table": rows, **({"encode_threads": threads} if threads else {})}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def _photo_rows(folder: Path, n: int = 512):
    """``n`` RGB JPEG files of 300 × 400 pixels (seeded random pixels: a photo's size, not its content)."""
    import numpy as np
    from PIL import Image

    from privtune.data import ImageDataset

    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        paths.append(str(folder / f"{i}.jpg"))
        Image.fromarray(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)).save(paths[-1], quality=90)
    return ImageDataset(images=paths, labels=[0] * n)


def _encode_table(train, args) -> dict:
    """Wall-clock ms per image of ``Classifier.encode`` in micro-batches, at each thread count, on the embedded
    Fashion-MNIST rows (28 px greyscale, in memory) and on JPEG files of a photo's size."""
    import tempfile

    import torch
    from torch import nn

    from privtune.models.vision import build_vision_classifier

    counts = [int(t) for t in args.threads.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        inputs = {"fashion-mnist rows (28 x 28 greyscale, in memory)": train,
                  "JPEG files (300 x 400 RGB, seeded random pixels)": _photo_rows(Path(tmp))}
        for name, data in inputs.items():
            for size in (int(s) for s in args.sizes.split(",")):
                net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())  # never run
                clf = build_vision_classifier(net, 10, image_size=size)
                first = None
                timed = {}
                for t in counts:
                    torch.set_num_threads(t)
                    runs = []
                    for p in range(args.passes + 1):  # the first pass warms up (and starts the threads)
                        start = time.perf_counter()
                        for k in range(0, len(data), args.batch):
                            x = clf.encode(data, range(k, min(k + args.batch, len(data))))["pixel_values"]
                            if k == 0 and p == 0:
                                first = x if first is None else first
                                if not torch.equal(x, first):
                                    raise SystemExit("encode gives other pixels on more threads: fix privtune first")
                        runs.append((time.perf_counter() - start) / len(data) * 1e3)
                    timed[t] = {"ms_per_image": statistics.median(runs[1:]), "runs": runs[1:]}
                base = timed[counts[0]]["ms_per_image"]
                print(f"{name}, {size} px: " + ", ".join(
                    f"{t} thread(s) {v['ms_per_image']:.3f} ms/image ({base / v['ms_per_image']:.2f}x)"
                    for t, v in timed.items()), flush=True)
                rows.append({"input": name, "image_size": size, "images": len(data),
                             **{f"threads_{t}_ms_per_image": v["ms_per_image"] for t, v in timed.items()},
                             "speedup_over_first": {str(t): base / v["ms_per_image"] for t, v in timed.items()},
                             "runs": {str(t): v["runs"] for t, v in timed.items()}})
    torch.set_num_threads(1)
    return {"clock": "wall", "statistic": "median over passes", "thread_counts": counts, "table": rows}


if __name__ == "__main__":
    main()
