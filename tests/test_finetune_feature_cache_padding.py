"""cache_features (tokenized once, deduplicated, length-sorted, each batch padded to its own longest text) gives
the features of one batch padded to the longest text, in the dataset's order, up to float rounding."""

from __future__ import annotations

import pytest
import torch

from privtune.data import TextDataset
from privtune.finetune import cache_features
from privtune.models import load_classifier
from privtune.models.testing import make_tiny_text_model, make_toy_text_dataset


def _data() -> TextDataset:
    toy = make_toy_text_dataset(40, seed=3, min_words=1, max_words=14)
    texts = list(toy.texts) + [toy.texts[5], toy.texts[0], "good"]  # duplicates, a one-word text
    return TextDataset(texts=texts, labels=list(toy.labels) + [toy.labels[5], toy.labels[0], 1], num_labels=2)


@pytest.mark.parametrize("arch", ["bert", "roberta", "gpt2"])
def test_sorted_dynamic_padding_matches_one_padded_batch(tmp_path, arch):
    model = load_classifier(make_tiny_text_model(tmp_path / arch, arch=arch, sentence_transformers=True))
    data = _data()
    with torch.no_grad():
        reference = model.features(**model.encode_texts(data.texts))  # unsorted, padded to the longest
    done = []
    fs = cache_features(model, data, batch_size=4, progress=done.append)
    assert fs.features.shape == reference.shape and sum(done) == len(data)
    assert torch.allclose(fs.features, reference, rtol=0, atol=1e-5)
    assert torch.equal(fs.features[len(data) - 3], fs.features[5]) and torch.equal(fs.features[len(data) - 2], fs.features[0])
    # a normal tensor, not an inference-mode one: training the head on it saves it for backward
    head = torch.nn.Linear(fs.num_features, 2)
    head(fs.features).sum().backward()
    assert head.weight.grad is not None


def test_caching_threads_use_only_idle_cores(monkeypatch, tmp_path):
    import privtune.finetune.last_layer as ll

    monkeypatch.setattr(ll.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        monkeypatch.setattr(ll.os, "getloadavg", lambda: (0.1, 0.1, 0.1))
        assert ll.caching_threads() == 4  # idle: torch's setting
        monkeypatch.setattr(ll.os, "getloadavg", lambda: (2.2, 2.0, 2.0))
        assert ll.caching_threads() == 2
        monkeypatch.setattr(ll.os, "getloadavg", lambda: (7.5, 8.0, 8.0))
        assert ll.caching_threads() == 1  # oversubscribed: one thread
        seen = []
        model = load_classifier(make_tiny_text_model(tmp_path / "bert", sentence_transformers=True))
        cache_features(model, _data(), progress=lambda k: seen.append(torch.get_num_threads()))
        assert set(seen) == {1} and torch.get_num_threads() == 4  # restored afterwards
    finally:
        torch.set_num_threads(before)
