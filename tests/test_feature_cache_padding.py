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
