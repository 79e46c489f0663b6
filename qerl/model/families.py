"""What each supported model family changes in the one decoder (`transformer.py`); everything not listed is Llama's.

One `Family` per Hugging Face `model_type`: the decoder, the config reader and writer (`ModelConfig.from_hf` /
`to_hf`) and LoRA's target names read their differences from here, so adding a family is one entry (plus tests).

The README's "Supported model families" table says the same for users, with the decode kernels each family runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' `layer_types` values


@dataclass(frozen=True)
class Family:
    architecture: str  # transformers' *ForCausalLM class, written into exported config.json files
    qkv_bias_only: bool = False  # Qwen2: bias on q/k/v always, never on o_proj (else `attention_bias` for all four)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE
    unit_offset_norms: bool = False  # Gemma: RMSNorm weight w applied as (1 + w), in fp32, rounded once
    sandwich_norms: bool = False  # Gemma: also norm the attention and MLP outputs (post_attention_layernorm,
    # pre_feedforward_layernorm, post_feedforward_layernorm), so post_attention_layernorm means something else
    scaled_embeddings: bool = False  # Gemma: embeddings * sqrt(hidden_size), the factor rounded to the dtype
    stacked_projections: bool = False  # Phi-3: checkpoint holds qkv_proj and gate_up_proj, not q/k/v, gate/up
    sliding: str = "never"  # "never"; "all": every layer when `sliding_window` is set; "layer_types": per layer
    activation_key: str = "hidden_act"  # config key of the MLP activation (Gemma: hidden_activation)
    config_defaults: dict[str, Any] = field(default_factory=dict)  # transformers' defaults for keys a file may omit

    @property
    def lora_target_aliases(self) -> dict[str, str]:
        """Names in LoRA target_modules that this family's modules answer to under another name."""
        if not self.stacked_projections:
            return {}
        return {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM"),
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias_only=True),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True),
    "mistral": Family("MistralForCausalLM", sliding="all"),
    "phi3": Family("Phi3ForCausalLM", stacked_projections=True, sliding="all"),
    "gemma3_text": Family("Gemma3ForCausalLM", qk_norm=True, unit_offset_norms=True, sandwich_norms=True,
                          scaled_embeddings=True, sliding="layer_types", activation_key="hidden_activation",
                          config_defaults={"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
                                           "sliding_window": 4096, "sliding_window_pattern": 6,
                                           "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                           "tie_word_embeddings": True}),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


# Near misses, said in the one-line refusal.
_HINTS = {"gemma3": "the multimodal Gemma 3: save its text decoder (transformers' Gemma3ForCausalLM, model_type "
                    "gemma3_text) and load that",
          "gemma2": "Gemma 2 (attention soft-capping) is not supported; Gemma 3 text is (gemma3_text)"}


def unsupported(model_type: Any, architectures: Any = None) -> ValueError:
    """The one-line error for a `model_type` no family covers, naming the supported ones."""
    hint = f" ({_HINTS[model_type]})" if model_type in _HINTS else ""
    return ValueError(f"unsupported model_type {model_type!r} (architectures {architectures}){hint}; supported: "
                      f"{', '.join(SUPPORTED_MODEL_TYPES)}")


def family(model_type: str) -> Family:
    """The family of a `model_type`; an unsupported one fails in one line naming the supported ones."""
    if model_type not in FAMILIES:
        raise unsupported(model_type)
    return FAMILIES[model_type]


def layer_types(fam: Family, config: dict[str, Any], num_layers: int) -> list[str] | None:
    """Each layer's attention kind (`FULL` / `SLIDING`) as the family reads a config; None = all full."""
    if fam.sliding == "never" or config.get("sliding_window") is None:
        return None
    if fam.sliding == "all":
        return [SLIDING] * num_layers
    types = config.get("layer_types")
    if types is None:  # older Gemma 3 files: every `sliding_window_pattern`-th layer is global
        pattern = config["sliding_window_pattern"]
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {FULL, SLIDING}:
        raise ValueError(f"layer_types must name {FULL!r} or {SLIDING!r} for each of {num_layers} layers, "
                         f"got {types}")
    return None if SLIDING not in types else list(types)
