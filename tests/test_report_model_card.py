"""privtune.report.write_model_card: Hugging Face model-card front matter and the guarantee in words."""

from __future__ import annotations

import json

import pytest
import yaml

from test_report_html import make_run  # noqa: E402  (tests/ is on sys.path under pytest)

from privtune.report import write_model_card


def _split(text):
    assert text.startswith("---\n")
    fm, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(fm), body


def test_model_card_front_matter_and_guarantee(tmp_path):
    run = make_run(tmp_path / "run")
    path = write_model_card(run)
    assert path == run / "model" / "README.md"
    fm, body = _split(path.read_text())
    assert "differential-privacy" in fm["tags"]
    assert fm["base_model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert fm["datasets"] and fm["metrics"] == ["accuracy"]
    acc = fm["model-index"][0]["results"][0]["metrics"][0]
    assert acc["type"] == "accuracy" and acc["value"] == pytest.approx(0.832)
    cert = json.loads((run / "certificate.json").read_text())
    assert f"ε = {cert['epsilon']:.4g}" in body and "δ = 1.0e-05" in body
    assert "one training example is added or removed" in body
    assert "hyperparameter tuning (6 trials" in body and "**and** the final training run" in body
    assert "PLD" in body
    for public in ("pretrained weights", "declared public", "search space"):
        assert public in body
    assert "NOT PRIVATE" in body  # reference model and clipping diagnostics are named as such
    # the copy inside model/: the directory can be shared on its own
    assert "privtune account --certificate certificate.json" in body and "(certificate.json)" in body
    assert "../" not in body


def test_model_card_grid_oracle_states_no_guarantee(tmp_path):
    run = make_run(tmp_path / "run", "grid-oracle", reference=False, clipping=False)
    fm, body = _split(write_model_card(run).read_text())
    assert "not-private-reference" in fm["tags"]
    assert "**NOT PRIVATE (reference only).**" in body and "no** end-to-end" in body


def test_model_card_custom_base_model_and_data(tmp_path):
    run = make_run(tmp_path / "run", "train", reference=False, clipping=False)
    (run / "config.yaml").write_text("model: /models/my-bert\ndata: /data/reviews.tsv\nepsilon: 1.0\n")
    fm, body = _split(write_model_card(run).read_text())
    assert fm["base_model"] == "my-bert" and fm["datasets"] == ["reviews"]
    assert "the training run that produced it" in body and "search space" not in body
    assert "the evaluation split on which accuracy is reported" in body
    # a run without evaluation data names no evaluation split among what it treats as public
    metrics = json.loads((run / "metrics.json").read_text())
    (run / "metrics.json").write_text(json.dumps({**metrics, "accuracy": None}))
    fm, body = _split(write_model_card(run).read_text())
    assert "evaluation split" not in body and "model-index" not in fm


def test_model_card_names_the_training_file_not_its_path(tmp_path):
    run = make_run(tmp_path / "run", "train", reference=False, clipping=False)
    (run / "config.yaml").write_text("data: /home/alice/secret/reviews.tsv\nepsilon: 1.0\n")
    metrics = json.loads((run / "metrics.json").read_text())
    metrics["reported_split"] = "/home/alice/secret/dev.tsv"
    (run / "metrics.json").write_text(json.dumps(metrics))
    text = write_model_card(run).read_text()
    assert "reviews.tsv" in text and "dev.tsv" in text and "/home/alice" not in text


def test_model_card_of_the_demo_says_the_demo_declared_its_split_public(tmp_path):
    run = make_run(tmp_path / "run", "hyperfree", reference=False, clipping=False)
    (run / "config.yaml").write_text("epsilon: 1.0\nstrategy: hyperfree\n")  # no --data: the embedded demo
    _, body = _split(write_model_card(run).read_text())
    assert "declared public by the demo" in body and "the user declared public" not in body


def _as_image_run(run, *, demo: bool = False):
    """``make_run``'s directory with the files a released image model has (its kind, its preprocessing)."""
    model = run / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "privtune_classifier.json").write_text(json.dumps(
        {"base_model": "efficientnet-lite0", "kind": "image", "num_labels": 10, "pooling": "mean"}))
    (model / "privtune_image_preprocessor.json").write_text(json.dumps(
        {"image_size": 96, "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]}))
    if demo:
        (run / "config.yaml").write_text("data: embedded:fashion-mnist\nmodel: efficientnet-lite0\nepsilon: 1.0\n")
    return run


def test_model_card_of_an_image_model_says_image_classification_and_how_images_go_in(tmp_path):
    run = _as_image_run(make_run(tmp_path / "run", "hyperfree", reference=False, clipping=False))
    fm, body = _split(write_model_card(run).read_text())
    assert fm["pipeline_tag"] == "image-classification"
    assert "image-classification" in fm["tags"] and "text-classification" not in fm["tags"]
    assert fm["model-index"][0]["results"][0]["task"]["type"] == "image-classification"
    assert "library_name" not in fm  # not loadable by transformers: privtune's own files
    assert fm["base_model"] == "efficientnet-lite0"
    assert "96 × 96 pixels" in body and "mean (0.5, 0.5, 0.5)" in body
    assert "--data path/to/images/" in body and ".tsv" not in body


def test_model_card_of_a_text_model_keeps_text_classification(tmp_path):
    fm, body = _split(write_model_card(make_run(tmp_path / "run", reference=False, clipping=False)).read_text())
    assert fm["pipeline_tag"] == "text-classification" and fm["library_name"] == "transformers"
    assert "## Inputs" not in body and "examples.tsv" in body


def test_image_demo_card_and_report_describe_images(tmp_path):
    from privtune.report import write_report

    run = _as_image_run(make_run(tmp_path / "run", "hyperfree", reference=False, clipping=False), demo=True)
    fm, body = _split(write_model_card(run).read_text())
    assert fm["pipeline_tag"] == "image-classification" and fm["datasets"] == ["zalando-datasets/fashion_mnist"]
    assert "images of the image demo's public validation split" in body and "phrase" not in body
    html_text = write_report(run).read_text()
    assert "the image model (privtune" in html_text and "Hugging Face save_pretrained" not in html_text


def test_a_mode_auto_run_states_the_union_bound_guarantee(tmp_path):
    """--mode auto's pilots chose one of k plans, each made at δ/k: the card and the report state (total ε, δ), the
    guarantee of the union bound over the plans, and the events' own ε beside it; other runs keep the
    certificate's ε."""
    from privtune.report import write_report

    run = make_run(tmp_path / "run", "hyperfree", reference=False, clipping=False)
    cert = json.loads((run / "certificate.json").read_text())
    events_eps = cert["epsilon"]
    _, body = _split(write_model_card(run).read_text())
    assert f"(ε = {events_eps:.4g}, δ = 1.0e-05)-differentially private" in body and "union bound" not in body
    cert["metadata"].update(mode_plans=3, total_epsilon_requested=round(events_eps + 0.5, 3))
    (run / "certificate.json").write_text(json.dumps(cert))
    total = f"{events_eps + 0.5:.4g}"
    fm, body = _split(write_model_card(run).read_text())
    assert f"This model is **(ε = {total}, δ = 1.0e-05)-differentially private**" in body
    assert "at δ/3; by a union bound over the plans" in body and f"compose to ε = {events_eps:.4g} at" in body
    html = write_report(run).read_text()
    assert f"<b>(ε = {total}, δ = 1.0e-05)-differentially private</b>" in html and "union bound" in html
