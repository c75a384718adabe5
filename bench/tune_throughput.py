"""tune's DP-BiTFiT path vs the engine's DP-BiTFiT step: examples per CPU second, one run.

In ONE invocation, each in a fresh process on one CPU thread (torch.set_num_threads(1), OMP_NUM_THREADS=1):

(a) engine   ``bench/engine.py --child bitfit privtune``: PrivateGradient (flat clipping, σ = 1) + Adam on
             all-MiniLM-L6-v2 + mean pooling, B = 32, every sentence padded to 64 tokens (engine.py's own
             figure, same code, timed steps after one warm-up step).
(b) tune     ``privtune.tune(mode="bitfit", strategy="hyperfree")`` on an SST-2 subsample (``--subset``
             training phrases, labels declared ``[0, 1]``), the bundled MiniLM saved with max_length = 64,
             expected batch ``--batch-size`` (Poisson, q = B / n_train), ``--steps`` DP steps, ε = 8, a
             throw-away sqlite ledger and output folder in a temp dir.  The DP steps are timed by wrapping
             ``training._Loop._one_step`` with ``time.process_time()``: each step = Poisson sampling,
             tokenisation of the physical batches (32), forward, clipped per-example backward, noisy release,
             the optimizer step and hyperfree's LearningRateProbe hook (its loss-probe forward passes on
             the same batch).  Counted examples = the size of each Poisson batch (``_Loop.examples``).
             The time spent inside the hooks is reported separately.  The first DP step is a warm-up and
             is not counted.  Setup (loading, splitting, accounting, evaluation, writing) is not timed.

    OMP_NUM_THREADS=1 python bench/tune_throughput.py                 # about 24 min (1,431 s) on the shared, loaded 2-core machine
    OMP_NUM_THREADS=1 python bench/tune_throughput.py --profile       # + cProfile of the tune path (top 10)

Results: printed table, plus bench/results/tune_throughput.json (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import offline  # noqa: E402,F401  (sets the offline environment: bench/offline.py)
os.environ.setdefault("OMP_NUM_THREADS", "1")

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
from hpo import SST2, read_sst2_tsv  # noqa: E402  (bench/ is on sys.path: this script's folder)
TARGET = 0.9


def tune_child(subset: int, batch_size: int, steps: int, max_length: int, profile: bool, pad_to_max: bool) -> dict:
    import torch

    torch.set_num_threads(1)
    import privtune
    from privtune import training
    from privtune.models import classifier as classifier_module
    from privtune.models import load_classifier

    if pad_to_max:  # like-for-like with engine.py: every sentence padded to max_length tokens (bench only)
        def encode_texts_padded(self, texts):
            enc = self.tokenizer(list(texts), padding="max_length", truncation=True, max_length=self.max_length,
                                 return_tensors="pt")
            return {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        classifier_module.Classifier.encode_texts = encode_texts_padded

    texts, labels = read_sst2_tsv(SST2 / "train.tsv")
    idx = list(range(len(texts)))
    random.Random(0).shuffle(idx)
    idx = idx[:subset]
    timing = {"cpu": [], "examples": [], "hook_cpu": []}
    original = training._Loop._one_step

    def timed_one_step(self, *a, **kw):
        if not getattr(self, "_bench_hooks_wrapped", False):  # time the hooks separately (hyperfree's probe)
            for hook in self.hooks:
                for name in ("before_step", "after_step"):
                    fn = getattr(hook, name)

                    def wrapped(*ha, _fn=fn, **hk):
                        h0 = time.process_time()
                        try:
                            return _fn(*ha, **hk)
                        finally:
                            timing["_hook"] = timing.get("_hook", 0.0) + time.process_time() - h0
                    setattr(hook, name, wrapped)
            self._bench_hooks_wrapped = True
        timing["_hook"] = 0.0
        e0, c0 = self.examples, time.process_time()
        out = original(self, *a, **kw)
        timing["cpu"].append(time.process_time() - c0)
        timing["examples"].append(self.examples - e0)
        timing["hook_cpu"].append(timing["_hook"])
        return out

    training._Loop._one_step = timed_one_step
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "train.tsv"
        with open(data, "w", encoding="utf-8") as f:
            f.write("label\tsentence\n" + "".join(f"{labels[i]}\t{texts[i]}\n" for i in idx))
        # tune has no max_length argument: give it the bundled MiniLM saved with max_length = 64
        model_dir = tmp / "minilm64"
        load_classifier(None, num_labels=2, max_length=max_length).save_pretrained(model_dir)
        n_train = None

        def run():
            return privtune.tune(data, model=str(model_dir), mode="bitfit", strategy="hyperfree", epsilon=8.0,
                                 delta=1e-5, labels=[0, 1], ledger=f"sqlite:///{tmp}/ledger.db",
                                 output_dir=tmp / "run", seed=0, steps=steps + 1, batch_size=batch_size, quiet=True)

        t0 = time.perf_counter()
        if profile:
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            r = prof.runcall(run)
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(25)
            prof_text = s.getvalue()
        else:
            r, prof_text = run(), None
        wall = time.perf_counter() - t0
        cfg = {k: r.config.get(k) for k in ("sample_rate", "batch_size", "steps")} if isinstance(
            getattr(r, "config", None), dict) else {}
    training._Loop._one_step = original
    cpu, ex, hk = timing["cpu"][1:], timing["examples"][1:], timing["hook_cpu"][1:]  # step 1 = warm-up
    return {"method": "tune", "pad_to_max": pad_to_max, "hook_cpu_s_warmup": timing["hook_cpu"][0], "steps_timed": len(cpu), "examples": sum(ex), "cpu_s": sum(cpu),
            "hook_cpu_s": sum(hk), "examples_per_cpu_s": sum(ex) / sum(cpu) if cpu else None,
            "examples_per_cpu_s_without_hooks": sum(ex) / (sum(cpu) - sum(hk)) if cpu else None,
            "batch_sizes": timing["examples"], "step_cpu_s": timing["cpu"], "tune_wall_s": wall,
            "certificate_epsilon": r.certificate.epsilon, "config": cfg, "n_train": n_train,
            "profile": prof_text}


def engine_figure(steps: int, warmup: int) -> dict:
    cmd = [sys.executable, str(HERE / "engine.py"), "--child", "bitfit", "privtune", "--steps", str(steps),
           "--warmup", str(warmup), "--batch-size", "32", "--max-length", "64"]
    env = {**os.environ, "PRIVTUNE_SST2": str(SST2 / "train.tsv")}  # engine.py's fallback: a file path
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in p.stdout.splitlines()[::-1]:
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit("engine.py child failed: " + (p.stderr.strip().splitlines() or ["?"])[-1])


def tune_figure(args, steps: int, profile=False, pad_to_max=False) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-tune", "--subset", str(args.subset),
           "--batch-size", str(args.batch_size), "--steps", str(steps), "--max-length", str(args.max_length)]
    if profile:
        cmd.append("--profile")
    if pad_to_max:
        cmd.append("--pad-to-max")
    p = subprocess.run(cmd, capture_output=True, text=True)
    for line in p.stdout.splitlines()[::-1]:
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit("tune child failed:\n" + "\n".join(p.stderr.strip().splitlines()[-15:]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--subset", type=int, default=4000, help="SST-2 training phrases given to tune")
    ap.add_argument("--batch-size", type=int, default=1000, help="tune's expected (Poisson) batch size")
    ap.add_argument("--steps", type=int, default=5,
                    help="timed DP steps of tune (plus one warm-up step); 5 = one hyperfree η interval, so the "
                         "timed steps include hyperfree's loss probes at their real rate (1 step in 5)")
    ap.add_argument("--padded-steps", type=int, default=5,
                    help="timed steps of the like-for-like run (tune with every sentence padded to max_length); 0: skip")
    ap.add_argument("--pad-to-max", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--engine-steps", type=int, default=30, help="timed engine steps of B = 32")
    ap.add_argument("--profile", action="store_true", help="also run a cProfile of the tune path (top 10)")
    ap.add_argument("--child-tune", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_tune:
        res = tune_child(args.subset, args.batch_size, args.steps, args.max_length, args.profile, args.pad_to_max)
        print("RESULT " + json.dumps(res))
        return 0
    if not (SST2 / "train.tsv").is_file():
        sys.exit(f"SST-2 not found at {SST2}; set PRIVTUNE_SST2 to the folder with train.tsv")
    t0 = time.time()
    eng = engine_figure(args.engine_steps, 1)
    print(f"  engine: {eng['examples_per_cpu_s']:.1f} ex/CPU-s ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    tun = tune_figure(args, args.steps)
    print(f"  tune:   {tun['examples_per_cpu_s']:.1f} ex/CPU-s ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    pad = tune_figure(args, args.padded_steps, pad_to_max=True) if args.padded_steps > 0 else None
    if pad:
        print(f"  tune padded: {pad['examples_per_cpu_s']:.1f} ex/CPU-s ({time.time() - t0:.0f} s)", file=sys.stderr,
              flush=True)
    e = eng["examples_per_cpu_s"]
    ratio = tun["examples_per_cpu_s"] / e
    verdict = "MET" if ratio >= TARGET else "NOT MET"

    def row(name, r):
        x = r["examples_per_cpu_s"]
        return (f"| {name} | {r['steps_timed']} ({r['examples']} ex., batches {r['batch_sizes'][1:]}) | "
                f"{r['hook_cpu_s']:.1f} of {r['cpu_s']:.1f} | {e:.1f} | {x:.1f} | {x / e:.2f}× | {TARGET}× | "
                f"{'MET' if x / e >= TARGET else 'NOT MET'} |")

    lines = [
        "DP-BiTFiT, all-MiniLM-L6-v2 + SST-2, 1 CPU thread, examples per CPU second (time.process_time)",
        f"engine: bench/engine.py bitfit/privtune, B = 32, every sentence padded to {args.max_length}, "
        f"{eng['steps']} timed steps after 1 warm-up",
        f"tune:   privtune.tune(mode='bitfit', strategy='hyperfree'), {args.subset} SST-2 phrases, expected B = "
        f"{args.batch_size} (Poisson), max_length {args.max_length}, physical batches of 32, DP steps timed "
        f"after 1 warm-up step",
        "",
        "| tune run | timed DP steps | hook CPU-s of step CPU-s | engine ex/CPU-s | tune ex/CPU-s | ratio | target | verdict |",
        "|---|---|---|---|---|---|---|---|",
        row("as shipped (pads to the longest phrase of each physical batch)", tun),
    ]
    if pad:
        lines.append(row(f"like-for-like: every phrase padded to {args.max_length} (bench-only patch)", pad))
    lines += ["", f"whole script: {time.time() - t0:.0f} s wall"]
    out = {"engine": eng, "tune": tun, "tune_padded": pad, "ratio": ratio, "target": TARGET, "verdict": verdict, "args": vars(args)}
    if args.profile or ratio < TARGET:
        prof = tune_figure(args, 1, profile=True)
        out["profile"] = prof["profile"]
        lines += ["", "cProfile of the tune path (1 timed + 1 warm-up step, whole tune call), by cumulative time:",
                  prof["profile"]]
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tune_throughput.json").write_text(json.dumps(out, indent=2))
    (RESULTS / "tune_throughput.log").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
