"""The DP step on privtune's own classifiers is exact: per-example norms and the clipped sum of
``PrivateGradient`` equal a naive per-example loop in float64, for every fine-tuning mode that
:func:`privtune.finetune.apply_mode` sets up, on the models :func:`privtune.models.load_classifier`
builds (mean-pooling head on a sentence-transformers BERT; the model's own head on RoBERTa, GPT-2
and ViT).  tests/test_engine_grad.py covers Hugging Face's heads with hand-picked parameters; this
file covers what `privtune train` actually trains.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from privtune.engine import PrivateGradient
from privtune.finetune import apply_mode
from privtune.models import load_classifier
from privtune.models.testing import make_tiny_image_model, make_tiny_text_model

pytest.importorskip("transformers")

B = 4
NUM_LABELS = 3
TEXTS = ["good movie", "the plot was very dull and the actors sad", "a fun film", "worst story"]
ARCHS = ("bert-mean", "roberta", "gpt2", "vit")
MODES = ("full", "bitfit", "last-layer", "lora")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("exact")
    return {
        "bert-mean": make_tiny_text_model(root / "bert", sentence_transformers=True),
        "roberta": make_tiny_text_model(root / "roberta", arch="roberta"),
        "gpt2": make_tiny_text_model(root / "gpt2", arch="gpt2"),
        "vit": make_tiny_image_model(root / "vit"),
    }


def _inputs(clf, arch):
    if arch == "vit":
        g = torch.Generator().manual_seed(2)
        return {"pixel_values": torch.randn(B, 3, 8, 8, generator=g, dtype=torch.float64)}
    enc = clf.encode_texts(TEXTS)
    assert bool((enc["attention_mask"] == 0).any()), "the batch must contain padding"
    return enc


def _naive(clf, inputs, y, params):
    """Per-example gradients by a loop over batches of one (rows of the same padded batch)."""
    rows = []
    for i in range(B):
        one = {k: v[i:i + 1] for k, v in inputs.items()}
        loss = F.cross_entropy(clf(**one), y[i:i + 1])
        gs = torch.autograd.grad(loss, params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(gs, params)]))
    return torch.stack(rows)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_dp_step_on_privtune_classifier_matches_naive_loop(paths, arch, mode):
    if mode == "lora":
        pytest.importorskip("peft")
    clf = load_classifier(paths[arch], num_labels=NUM_LABELS, seed=0)
    assert clf.pooling == ("mean" if arch == "bert-mean" else "model")
    apply_mode(clf, mode, lora_rank=2)
    clf.double().eval()
    if mode == "lora":  # LoRA B starts at zero: perturb it so the gradient of A is exercised too
        with torch.no_grad():
            for n, p in clf.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    params = [p for p in clf.parameters() if p.requires_grad]
    inputs = _inputs(clf, arch)
    y = torch.tensor([0, 1, 2, 1])

    G = _naive(clf, inputs, y, params)
    ref_norms = G.norm(dim=1)
    assert bool((ref_norms > 0).all())
    C = float(ref_norms.median())  # clipping active for about half of the examples
    ref_sum = ((C / ref_norms).clamp(max=1.0)[:, None] * G).sum(0)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ViT's own cls_token / position_embeddings use the announced fallback
        pg = PrivateGradient(clf, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=1.0)
    try:
        norms = pg.backward(F.cross_entropy(clf(**inputs), y, reduction="none"))
        pg.release()
    finally:
        pg.close()
    got = torch.cat([p.grad.reshape(-1) for p in params])
    assert torch.allclose(norms, ref_norms, rtol=1e-6, atol=0), (norms, ref_norms)
    assert float((got - ref_sum).norm()) <= 1e-6 * float(ref_sum.norm())
    # what is trained is what the mode says: the head always, and more than the head except last-layer
    head = {id(p) for p in clf.classification_head.parameters()}
    assert head <= {id(p) for p in params}
    assert (len(params) == len(head)) == (mode == "last-layer")
