"""The architecture of one decoder: `ModelConfig`, read from (and written back to) a Hugging Face `config.json`.

What each family changes is described once, in `qerl.model.families`; `from_hf` rejects what the decoder does not
compute (partial RoPE, bidirectional attention, ...) in one line naming the key.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from qerl.model.families import FULL, SLIDING, SUPPORTED_MODEL_TYPES, Family, family, layer_types, unsupported

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # hidden_act: SwiGLU, Gemma's GeGLU (qerl.model.transformer.MLP)
_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass
class ModelConfig:
    """Architecture of one decoder; `from_hf` reads a Hugging Face `config.json` dict."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF rope parameters without rope_theta; None = plain RoPE
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2: always)
    attention_out_bias: bool = False  # bias on o_proj (Llama/Qwen3 `attention_bias`; never Qwen2)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str | None = None  # dtype the checkpoint was saved in
    # Families past Llama/Qwen (qerl.model.families); the defaults are Llama's.
    hidden_act: str = "silu"  # MLP activation: SwiGLU ("silu") or GeGLU ("gelu_pytorch_tanh")
    sliding_window: int | None = None  # keys a sliding layer attends to (itself included); None = no sliding layer
    layer_types: list[str] | None = None  # per layer FULL or SLIDING attention; None = all full
    rope_local_theta: float | None = None  # RoPE base of sliding layers (Gemma 3); None = rope_theta
    query_pre_attn_scalar: float | None = None  # softmax scale = this ** -0.5 (Gemma); None = head_dim ** -0.5
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) where set

    @classmethod
    def from_hf(cls, config: dict[str, Any] | Any) -> "ModelConfig":
        """Read a Hugging Face config (`config.json` as a dict, or a `PretrainedConfig`)."""
        if not isinstance(config, dict):
            config = config.to_dict()
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise unsupported(model_type, config.get("architectures"))
        fam = family(model_type)
        config = {**fam.config_defaults, **config}

        def need(key: str) -> Any:
            if config.get(key) is None:
                raise ValueError(f"{model_type} config lacks required key {key!r}")
            return config[key]

        if config.get("use_sliding_window"):
            raise ValueError("Qwen2 sliding-window attention (use_sliding_window=true) is not supported")
        if config.get("use_bidirectional_attention"):
            raise ValueError(f"{model_type}: use_bidirectional_attention=true is not supported (causal LMs only)")
        if config.get("attn_logit_softcapping") is not None:  # transformers' Gemma 3 never applies it
            raise ValueError(f"{model_type}: attn_logit_softcapping={config['attn_logit_softcapping']} is not "
                             "supported (transformers' Gemma 3 ignores it; its checkpoints set null)")
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        # transformers >= 5 folds rope_theta and the scaling into `rope_parameters` (keyed by layer kind where
        # they differ, as Gemma 3's local and global layers); older files use rope_theta and rope_scaling.
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        local_rope = None
        if FULL in rope or SLIDING in rope:
            local_rope = dict(rope.get(SLIDING) or {})
            rope = dict(rope.get(FULL) or {})
        rope_theta = float(rope.pop("rope_theta", None) or config.get("rope_theta") or 10000.0)
        partial = rope.pop("partial_rotary_factor", None) or config.get("partial_rotary_factor") or 1.0
        if partial != 1.0:
            raise ValueError(f"{model_type}: partial_rotary_factor={partial} (partial RoPE) is not supported")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(_ROPE_TYPES)}")
        intermediate, layers = need("intermediate_size"), need("num_hidden_layers")
        types = layer_types(fam, config, layers)
        rope_local_theta = None
        if fam.sliding == "layer_types" and types is not None:
            if (local_rope or {}).get("rope_type", "default") != "default":
                raise ValueError(f"{model_type}: only plain RoPE on sliding layers is supported, got {local_rope}")
            rope_local_theta = float((local_rope or {}).get("rope_theta") or need("rope_local_base_freq"))
        act = config.get(fam.activation_key) or config.get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise ValueError(f"{model_type}: unsupported activation {act!r}; supported: {', '.join(ACTIVATIONS)}")
        attn_bias = bool(config.get("attention_bias", False))
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            vocab_size=need("vocab_size"),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling={**rope, "rope_type": rope_type} if rope_type != "default" else None,
            max_position_embeddings=config.get("max_position_embeddings") or 4096,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=True if fam.qkv_bias_only else attn_bias,
            attention_out_bias=False if fam.qkv_bias_only else attn_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=fam.qk_norm,
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=config.get("eos_token_id"),
            torch_dtype=config.get("torch_dtype") or config.get("dtype"),
            hidden_act=act,
            sliding_window=int(config["sliding_window"]) if types is not None else None,
            layer_types=types,
            rope_local_theta=rope_local_theta,
            query_pre_attn_scalar=config.get("query_pre_attn_scalar"),
            final_logit_softcapping=config.get("final_logit_softcapping"),
        )

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face `config.json` dict that transformers (and `from_hf`) read back as this architecture."""
        fam = self.family
        d = asdict(self)
        for key in ("attention_out_bias", "qk_norm", "torch_dtype", "hidden_act", "layer_types", "rope_local_theta",
                    "sliding_window", "query_pre_attn_scalar", "final_logit_softcapping"):
            d.pop(key)
        d["architectures"] = [fam.architecture]
        d[fam.activation_key] = self.hidden_act
        d["attention_bias"] = True if fam.qkv_bias_only else self.attention_out_bias
        if fam.qkv_bias_only:
            d.pop("mlp_bias")
        if fam.sliding != "never":  # written even when None: transformers' default for an absent key is a window
            d["sliding_window"] = self.sliding_window
        if fam.sliding == "layer_types":
            d["layer_types"] = self.layer_types or [FULL] * self.num_hidden_layers
            d["rope_parameters"] = {
                FULL: {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta},
                SLIDING: {"rope_type": "default", "rope_theta": self.rope_local_theta or self.rope_theta}}
            d.pop("rope_theta"), d.pop("rope_scaling")
        for key in ("query_pre_attn_scalar", "final_logit_softcapping"):
            if getattr(self, key) is not None or key in fam.config_defaults:
                d[key] = getattr(self, key)
        if self.torch_dtype:
            d["torch_dtype"] = self.torch_dtype
        return d

    @property
    def family(self) -> Family:
        """What this architecture changes in the shared decoder (`qerl.model.families`)."""
        return family(self.model_type)

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends over a sliding window of `sliding_window` keys."""
        return self.layer_types is not None and self.layer_types[layer] == SLIDING

    @property
    def eos_token_ids(self) -> list[int]:
        """EOS ids as a list (configs store an int or a list)."""
        eos = self.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
