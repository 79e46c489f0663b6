"""The arms of the "does quantization noise help RL?" experiments: named sets of `section.key=value` overrides.

Prefect-free: `qerl.flows.compare` and the bare GPU driver (`benchmarks/aqn_seeds.py`) read the same table.
"""

from __future__ import annotations

from qerl.flows import startup  # noqa: F401 (first of all: the process's settings, before Prefect, MLflow, torch)

from qerl.config import ConfigError, split_overrides

# The paper's comparison (QeRL, arXiv 2510.11696, Fig. 5) plus the entropy-targeted schedule. `nf4-lora` is QLoRA's
# base format through qerl's own NF4 codec (quant.scheme: nf4); `qlora-bnb` is QLoRA itself (bitsandbytes' NF4
# storage and kernels: pip install -e ".[qlora]"), not in the default set since it needs that extra. `fp8` is the FP8
# base (quant.scheme: fp8, E4M3 with per-channel scales: half bf16's bytes; learned nearly as bf16 in the 2026-12-03
# study, -0.09 reward AUC on add2, issue #63).
# The NVFP4 remedies of issue #63 (README, "Remedies for a 4-bit base"): `nvfp4-fp8-sensitive` keeps in FP8 the two
# projection types whose NVFP4 error moves the policy most (docs/quant_error/summary.md, finding 5: down_proj and
# v_proj, ~40% of NVFP4's KL to bf16 together; no single layer dominates, so no layer index, which would also tie the
# arm to one depth); `nvfp4-correction` a frozen rank-16 SVD correction of every quantized weight; `nvfp4-aqn-norms`
# AQN on the block norms only, the paper's derivation (noise on a quantized layer's input channels: the final norm
# feeds the bf16 LM head).
ARMS: dict[str, list[str]] = {
    "bf16-lora": ["quant.scheme=bf16", "aqn.enabled=false"],
    "nf4-lora": ["quant.scheme=nf4", "aqn.enabled=false"],
    "nvfp4": ["quant.scheme=nvfp4", "aqn.enabled=false"],
    "nvfp4-aqn": ["quant.scheme=nvfp4", "aqn.enabled=true", "aqn.schedule=geometric"],
    "nvfp4-aqn-entropy": ["quant.scheme=nvfp4", "aqn.enabled=true", "aqn.schedule=entropy"],
    "qlora-bnb": ["quant.scheme=nf4-bnb", "aqn.enabled=false"],
    "fp8": ["quant.scheme=fp8", "aqn.enabled=false"],
    "nvfp4-fp8-sensitive": ["quant.scheme=nvfp4", "aqn.enabled=false",
                            'quant.layer_schemes={"*.down_proj": fp8, "*.v_proj": fp8}'],
    "nvfp4-correction": ["quant.scheme=nvfp4", "aqn.enabled=false", "quant.error_correction_rank=16"],
    "nvfp4-aqn-norms": ["quant.scheme=nvfp4", "aqn.enabled=true", "aqn.schedule=geometric",
                        "aqn.include_final_norm=false"],
}
# The same bases with W8A8 rollouts (quant.fp8_activations: true, the default until 2026-12-04: the studies of
# 2026-11-26 and 2026-12-03 ran `fp8`, `nvfp4` and `nvfp4-fp8-sensitive` so) and, pinned, with bf16 activations
# (the default since, after those W8A8 rollouts sampled another policy than the update trained: log-prob gap
# 0.09-0.15 against bf16's 0.02). Both twins keep their meaning whatever the default is.
for _twin in ("fp8", "nvfp4-fp8-sensitive", "nvfp4"):
    ARMS[f"{_twin}-w8a8"] = [*ARMS[_twin], "quant.fp8_activations=true"]
    ARMS[f"{_twin}-bf16-act"] = [*ARMS[_twin], "quant.fp8_activations=false"]
# The learning rate that suits a 4-bit base (issue #63 item 2): twice the default's, on the FP8-sensitive NVFP4 base
# with faithful rollouts and, so that a gain is NVFP4's and not the rate's, on bf16 LoRA too.
for _twin in ("bf16-lora", "nvfp4-fp8-sensitive-bf16-act"):
    ARMS[f"{_twin}-lr6e-4"] = [*ARMS[_twin], "optim.lr=6e-4"]
DEFAULT_ARMS = ["bf16-lora", "nf4-lora", "nvfp4", "nvfp4-aqn", "nvfp4-aqn-entropy"]


def parse_arm(spec: str) -> tuple[str, list[str]]:
    """`name` (built-in) or `name:section.key=value,section.key=value` (a value's commas inside its brackets or
    quotes stay its own: qerl.config.split_overrides)."""
    name, sep, body = spec.partition(":")
    if not sep:
        if name not in ARMS:
            raise ConfigError(f"--arms {spec}: unknown arm (built-in: {', '.join(ARMS)}; or define one as "
                              f"NAME:section.key=value,...)")
        return name, list(ARMS[name])
    overrides = split_overrides(body)
    if not name or not overrides or any("=" not in item for item in overrides):
        raise ConfigError(f"--arms {spec}: expected NAME:section.key=value[,section.key=value...]")
    return name, overrides
