"""Shared test setup: offline Hugging Face, deterministic, small thread counts (CI has 2 cores)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated_ledger(tmp_path, monkeypatch):
    """Never touch the user's real ~/.privtune ledger from a test."""
    monkeypatch.setenv("PRIVTUNE_LEDGER", f"sqlite:///{tmp_path / 'ledger.db'}")
    monkeypatch.setenv("PRIVTUNE_HOME", str(tmp_path / "privtune_home"))
    yield


@pytest.fixture(scope="session", autouse=True)
def _torch_threads():
    try:
        import torch
    except ImportError:  # pragma: no cover
        yield
        return
    torch.set_num_threads(1)
    yield
