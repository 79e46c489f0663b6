"""Shared pytest fixtures."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see qerl/__init__.py

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    """The real SmolLM2-135M-Instruct tokenizer with its chat template (no download): from the embedded model's
    cached Hugging Face folder, which the GGUF is converted into once."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded SmolLM2-135M-Instruct as a Hugging Face folder (converted once from the GGUF into the qerl cache,
    ~30 s the first time, instant afterwards)."""
    import torch

    from qerl.loading import embedded_model_path

    try:
        return embedded_model_path()
    except FileNotFoundError as e:
        if torch.cuda.is_available():  # the GPU machines cannot carry the 98 MB GGUF; CPU CI always has it
            pytest.skip(str(e))
        raise


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
