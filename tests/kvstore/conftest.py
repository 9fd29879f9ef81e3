"""Fixtures of the KV-tier tests: a tiny saved Llama checkpoint and tier/engine builders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.tiny_checkpoints import checkpoint


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama (GQA, 2 layers) with confident greedy margins: tokens compare exactly."""
    torch.set_num_threads(1)
    return checkpoint("llama", str(tmp_path_factory.mktemp("ckpt")))
