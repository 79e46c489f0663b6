"""Typed, validated run settings loaded from `params/*.yaml` with DVC-style `-S section.key=value` overrides.

Plain dataclasses and a small validator rather than pydantic: the core must import on the GPU machine, which has
only torch and friends. Every rejection is one line that names the key path, the value and (for files) the line.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.util
import json
import math
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from qerl.params_yaml import ConfigError, read_params_file, read_value, shortened
from qerl.plugins import SHAPE, split_spec

_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
DEFAULT_PARAMS = Path(__file__).resolve().parent.parent / "params" / "default.yaml"


class _RuleError(ConfigError):
    """Raised by a section's `validate`: `keys` name the fields the rule relates, so the error can point at where one
    was set (a `-S` flag among them first: that is what the user just typed)."""

    def __init__(self, keys: str | tuple[str, ...], message: str):
        super().__init__(message)
        self.keys = (keys,) if isinstance(keys, str) else keys


def _check(**bounds: float) -> dict:
    return {"bounds": bounds}


# Seeds go to torch.manual_seed and torch.Generator, which take 64 bits (beyond: "Overflow when unpacking long long").
_SEED = _check(ge=0, le=2**64 - 1)


# ---------------------------------------------------------------------------------------------------------------
# The schema. Field metadata `bounds` takes gt/ge/lt/le; cross-field rules live in each section's `validate`.
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class ModelSettings:
    path: str = "embedded"  # a Hugging Face folder, a .gguf file, our quantized folder, or "embedded" (SmolLM2-135M)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on CUDA, fp32 on the CPU
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Recompute blocks in backward to save activation memory: auto (as many as the free GPU memory needs, measured
    # per update, often none; never on the CPU), true (all), false (none). The number is logged per step.
    gradient_checkpointing: Literal["auto", True, False] = "auto"
    # The update's dequantized base weights (NVFP4 on the GPU kernels; bf16 bases' FP8 copies under base_gemm: fp8):
    # auto (kept from their first use to the update's end in the memory the kept activations leave, so each weight
    # is dequantized once per update, not twice per micro-batch; activations come first), true (all kept, whatever
    # the memory), false (dequantized per GEMM into one shared buffer: the least memory). auto keeps none where
    # gradient_checkpointing is true (a run that asked for memory first). Logged per step (held_weights_gib).
    keep_dequantized: Literal["auto", True, False] = "auto"
    # The blocks' RMSNorm / RoPE / SiLU·up on CUDA: auto (the measured fastest), eager (plain PyTorch), liger
    # (Liger-kernel's fused kernels; pip install liger-kernel), compile (torch.compile of the eager ops). Every
    # backend but eager also takes the update's LM-head log-probs in one kernel (kernels/vocab_softmax.py). The CPU
    # always runs eager. qerl/execution/training_ops.py.
    training_kernels: Literal["auto", "eager", "liger", "compile"] = "auto"
    # The frozen base's GEMMs in the update (forward and dx at training sizes): bf16 (dequantize + cuBLAS), or fp8
    # (opt-in; a GPU with FP8 tensor cores: NVFP4 bases are dequantized into FP8 E4M3, straight from the Gluon
    # layout or through bf16 from the others, bf16 bases quantized to it per call (qerl/quant/fp8.py), one scale per
    # weight row, activations and gradients scaled per row, torch._scaled_mm at twice bf16's tensor-core rate).
    # Rollouts are unaffected. Its agreement with bf16: BENCHMARKS.md, "An FP8 update".
    base_gemm: Literal["bf16", "fp8"] = "bf16"
    # The update runs each distinct prompt of a micro-batch through the blocks once, however many of its rows (a
    # GRPO group's completions) repeat it (qerl.execution.shared_prompts): the same log-probs and gradients to
    # float rounding, with 1/G of the prompt tokens. Not with LoRA dropout, whose masks the rows would share.
    share_prompts: bool = True
    # The update runs only the real tokens through the blocks' GEMMs and the LM head: the completions of a
    # micro-batch packed without their right padding (and the prompts without their left padding), attention still
    # per row on the padded layout. A micro-batch whose completions differ in length then costs its tokens, not rows
    # x the longest. Same log-probs and gradients to float rounding (tests); opt-in until measured on the GPU.
    pack_completions: bool = False
    # Rows whose loss has no gradient (advantage 0: a group whose rewards are all equal, or no loss token) run their
    # forward without autograd: no backward, no kept activations; the loss and its metrics still see them. Only
    # without the KL term (grpo.beta = 0), which gives every row a gradient.
    skip_idle_rows: bool = True
    # On CUDA, compile the run's GPU kernels in worker processes while the weights load (qerl.rl.precompile), so a
    # machine's first run does not compile them one by one in its first step (7B: first step 25.9 -> 17.3 s, for
    # ~21 s of workers that overlap the load; BENCHMARKS.md "The first step on a fresh machine"). Skipped when this
    # machine's Triton cache already holds them (a stamp per code version, shapes and settings). Opt-in for now.
    precompile_kernels: bool = False
    # PyTorch's intra-op threads on the CPU for training and evaluation (torch.set_num_threads); None: torch's own
    # choice, one per core. CPU results depend on it (a reduction split over 2 threads rounds otherwise than over 1),
    # so a run records the count it used (params.yaml, the checkpoints' settings, MLflow) and --resume names a
    # different one. README "Determinism".
    cpu_threads: Optional[int] = field(default=None, metadata=_check(gt=0))


def quant_schemes() -> tuple[str, ...]:
    """The values of quant.scheme: every codec of the registry, and bitsandbytes' NF4 (quantized at load)."""
    from qerl.quant import bnb, formats  # here, not at import: settings load without torch until validated

    return (*formats.SCHEMES, bnb.SCHEME)


@dataclass
class QuantSettings:
    # Format of the frozen base weights. nf4-bnb: QLoRA as its users run it, bitsandbytes' NF4 storage and kernels
    # (quantized at load; needs the `qlora` extra); nf4: qerl's own NF4 layout, through our dequantize path; fp8: E4M3
    # weights with one FP32 scale per output channel (compressed-tensors FP8_DYNAMIC), on FP8 tensor cores on CUDA
    # (kernels/fp8_gemm.py; its update in FP8 with model.base_gemm: fp8). One of quant_schemes(): the codecs of
    # qerl.quant.formats, plus nf4-bnb.
    scheme: str = "nvfp4"
    quantized_path: Optional[str] = None  # a folder written by `qerl quantize`; None = quantize in memory at load
    # The layout of the NVFP4 base on a CUDA GPU, i.e. which decode GEMM runs: auto (gluon on Hopper, else
    # humming-kernels' where installed, else qerl's Triton kernels), humming, qerl, or gluon (our Hopper decode
    # GEMM; BENCHMARKS.md, "Rollouts: the Gluon default"). A layer the chosen layout cannot hold keeps the default,
    # with a warning. Numerics differ between layouts only in GEMM rounding.
    gpu_layout: Literal["auto", "humming", "qerl", "gluon"] = "auto"
    # A resident FP8 copy (E4M3, one scale per output row, made once from the 4-bit codes) of each NVFP4 weight on
    # the GPU, so that GEMMs at many rows (decoding 64+ rows, prefill) run on FP8 tensor cores instead of the 4-bit
    # GEMM, which is compute-bound there (the dispatch measures both per shape and M, and keeps the faster); the FP8
    # update (model.base_gemm: fp8) reads it too. 1 byte per weight beside the 4-bit codes' 0.56. auto: on a GPU with
    # FP8 tensor cores where the copies take at most a fifth of its memory (7B and 14B on 80 GB or more, never 32B);
    # true: wherever FP8 tensor cores are; false: 4-bit weights only. Rollouts then differ from the update's
    # bf16 GEMMs by FP8's rounding: BENCHMARKS.md, "Rollouts at RL batch sizes", measures the log-prob gap.
    fp8_weights: Literal["auto", True, False] = "auto"
    # Outside the update (rollouts, prefill, evaluation) a forward may round its activations to FP8 E4M3, one scale
    # per row (W8A8 on FP8 tensor cores: the fp8 base's `_scaled_mm`, the NVFP4 base's FP8 copies), where the
    # dispatch measures that faster, as vLLM serves such checkpoints. false: activations stay bf16 there, as in the
    # bf16 update, so rollouts sample the policy the update trains, up to GEMM rounding (W8A16 and the 4-bit GEMMs);
    # fp8_weights auto is then off (the copies serve W8A8 only). Why false is the default (issue #63, BENCHMARKS.md
    # 2026-12-04): W8A8 rollouts' log-prob gap to the trainer was 0.09 nats/token on the fp8 base and 0.15 on NVFP4
    # with FP8 copies, against 0.02-0.03 with bf16 activations; on the FP8-sensitive NVFP4 base the reward AUC rose
    # +0.069 [+0.025, +0.116] (20 seeds); on 7B shapes the ragged GRPO step costs 0-4% more (NVFP4 1.01x, fp8
    # 0.96x), fixed 512-row rollouts 0.67x (NVFP4) and 0.71x (fp8). true: the faster W8A8 rollouts at many rows.
    fp8_activations: bool = False
    # Remedies for a 4-bit base that learns worse than bf16 (issue #63); both off by default until a GPU seed study
    # decides. layer_schemes: module-name glob (fnmatch on the linear's qualified name, e.g. "*.down_proj",
    # "model.layers.0.*") -> the scheme of the layers it matches (bf16 = kept unquantized, or a codec: fp8, nf4...);
    # the first matching glob wins, the others take `scheme`; a glob that matches no decoder linear is an error.
    layer_schemes: dict[str, str] = field(default_factory=dict)
    # A frozen rank-r correction beside each quantized linear: the truncated SVD of W - dequant(Q(W)), kept in bf16
    # and added as y += x B^T A^T. Not part of the LoRA adapter (SVD-initialised adapters collapse in RL, arXiv
    # 2512.23165) and never trained. 0 = off. qerl.quant.linear.QuantLinear.set_error_correction.
    error_correction_rank: int = field(default=0, metadata=_check(ge=0))

    @property
    def quantized_at_load_only(self) -> bool:
        """Whether this base exists only quantized in memory from the dense weights: a `qerl quantize` folder (and
        the vLLM backend, which serves one) holds one scheme for every layer and no error correction."""
        return bool(self.layer_schemes) or self.error_correction_rank > 0

    def base_record(self) -> dict[str, Any] | None:
        """What an adapter trained on a base quantized at load only records of it (qerl.model.lora.BASE_RECORD), for
        its export and evaluation to rebuild that base; None for a plain base. The globs as [glob, scheme] pairs: their
        order decides (the first match wins), and a JSON list keeps it where a mapping's order is easily lost."""
        if not self.quantized_at_load_only:
            return None
        return {"scheme": self.scheme, "layer_schemes": [list(item) for item in self.layer_schemes.items()],
                "error_correction_rank": self.error_correction_rank}

    def validate(self) -> None:
        schemes = quant_schemes()
        if self.scheme not in schemes:
            close = difflib.get_close_matches(self.scheme, schemes, n=1)
            raise _RuleError("scheme", f"scheme = {self.scheme!r}: expected one of {', '.join(map(repr, schemes))}"
                             + (f" (did you mean {close[0]!r}?)" if close else ""))
        if self.scheme == "nf4-bnb" and self.quantized_path:
            raise _RuleError("quantized_path", f"quantized_path = {self.quantized_path!r}: scheme nf4-bnb quantizes "
                             "at load (as transformers' load_in_4bit); leave quantized_path unset")
        self._validate_remedies()

    def _validate_remedies(self) -> None:
        from qerl.quant import formats

        for glob, scheme in self.layer_schemes.items():
            if scheme not in formats.SCHEMES:
                raise _RuleError("layer_schemes", f"layer_schemes[{glob!r}] = {scheme!r}: expected one of "
                                 f"{', '.join(map(repr, formats.SCHEMES))} (bf16 keeps the layers unquantized)")
        remedies = [key for key, on in (("layer_schemes", self.layer_schemes),
                                        ("error_correction_rank", self.error_correction_rank)) if on]
        if remedies and self.scheme in ("bf16", "nf4-bnb"):
            raise _RuleError((remedies[0], "scheme"), f"{remedies[0]} applies to a base qerl quantizes itself, not "
                             f"scheme = {self.scheme!r}")
        if remedies and self.quantized_path:
            raise _RuleError((remedies[0], "quantized_path"), f"{remedies[0]} is made at load from the dense "
                             f"weights; a `qerl quantize` folder ({self.quantized_path!r}) holds one scheme and no "
                             "error correction: leave quantized_path unset")


@dataclass
class LoraSettings:
    """LoRA hyperparameters (names as in PEFT's LoraConfig where they overlap); `qerl.model.lora` takes it whole."""

    rank: int = field(default=16, metadata=_check(gt=0))
    alpha: float = field(default=32.0, metadata=_check(gt=0))
    dropout: float = field(default=0.0, metadata=_check(ge=0, lt=1))
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    use_rslora: bool = False  # scaling alpha/sqrt(r) instead of alpha/r: keeps the update size stable at high rank
    train_norms: bool = False  # also train every RMSNorm weight, as the reference QeRL code does (PEFT modules_to_save)

    def __post_init__(self) -> None:
        # Built in code (not only from a parameter file, whose bounds are checked before this): check here too.
        if isinstance(self.target_modules, str):
            self.target_modules = [self.target_modules]
        self.target_modules = list(self.target_modules)
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoraSettings.rank must be a positive int, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoraSettings.alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraSettings.dropout must be in [0, 1), got {self.dropout!r}")
        if not all(isinstance(t, str) and t for t in self.target_modules):
            raise ValueError(f"LoraSettings.target_modules must be non-empty module names, got {self.target_modules!r}")

    def validate(self) -> None:
        if not self.target_modules:
            raise _RuleError("target_modules", "target_modules = []: name at least one linear layer (e.g. q_proj)")

    @property
    def scaling(self) -> float:
        """Multiplier of B @ A."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass
class RolloutSettings:
    prompts_per_step: int = field(default=8, metadata=_check(gt=0))
    group_size: int = field(default=8, metadata=_check(ge=2))  # completions per prompt (GRPO's G)
    max_new_tokens: int = field(default=256, metadata=_check(gt=0))
    temperature: float = field(default=1.0, metadata=_check(gt=0))
    top_p: float = field(default=1.0, metadata=_check(gt=0, le=1))
    top_k: int = field(default=0, metadata=_check(ge=0))  # 0 = off
    stop_strings: list[str] = field(default_factory=list)
    # The sampler of training and evaluation (qerl.rollout): engine = RolloutEngine (static KV cache, CUDA graphs),
    # reference = the same engine with graphs, fused kernels and bucketed shapes off (RolloutEngine.reference, what
    # qerl.rollout.generate.generate runs); auto = the engine on CUDA, the reference on the CPU; vllm = a vLLM engine
    # colocated in the trainer's process as TRL's colocate mode (qerl/rollout/vllm_backend.py; needs
    # pip install "qerl[vllm]"), loading the base from a folder (qerl.model.served) and the current LoRA each step.
    backend: Literal["auto", "engine", "reference", "vllm"] = "auto"
    # vllm only: the share of the whole GPU vLLM takes for its weights and KV cache (TRL's vllm_gpu_memory_utilization)
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata=_check(gt=0, le=1))
    # vllm only: how each step's adapter reaches vLLM: new_id (a new LoRA id per step, the old one removed) or reload
    # (one id, its tensors reloaded in place: vLLM's LoRARequest.load_inplace). Which is faster is not yet measured.
    vllm_lora_update: Literal["new_id", "reload"] = "new_id"
    # After each rollout the engine's KV cache hands its GPU memory back for the update and takes it again before the
    # next rollout, at the same addresses (no graph recapture): the update has that memory to keep activations in.
    release_kv_cache: bool = True
    # The engine's KV cache: model (the model's dtype) or fp8 (E4M3 with one scale per key/value vector,
    # qerl/execution/kv8.py: 0.56x the bytes that bound attention over long generations). fp8 needs the engine's fused
    # kernels on a GPU of compute capability 8.9+ (elsewhere the model's dtype, said in the log). Its effect on
    # speed and on the rollout/trainer log-prob gap: BENCHMARKS.md, "Rollouts at RL batch sizes". With backend vllm:
    # vLLM's own FP8 KV cache (its kv_cache_dtype "fp8": E4M3, one scale per tensor).
    kv_cache_dtype: Literal["model", "fp8"] = "model"
    # Speculative decoding of the rollout's tail (qerl/rollout/speculation.py): once at most `speculative_rows` rows
    # are live, each drafts up to `speculative_draft` tokens from text the run already has (its prompt's earlier
    # completions, kept in checkpoints; its group's siblings; its prompt: qerl/rollout/drafts.py, no draft model) and
    # one forward verifies them by the rejection rule, so the samples and log-probs are exactly the policy's.
    # off, on, or auto (on with the engine on CUDA; on the CPU a step's cost grows with its tokens: no gain there).
    speculative: Literal["off", "auto", "on"] = "off"
    speculative_rows: int = field(default=8, metadata=_check(gt=0))
    speculative_draft: int = field(default=7, metadata=_check(gt=0, lt=8))
    # Over-provisioned rollouts (APRIL, arXiv 2509.18521): x > 0 samples ceil(prompts_per_step * (1 + x)) prompts
    # (group_size completions each) and stops the rollout at the first host check where prompts_per_step groups
    # have every row finished (EOS, stop string or length); those groups (the first to finish; at the same check the
    # lowest prompt index) are scored and trained on, the others' rows are cut (stop reason "cut") and dropped, so a
    # step no longer waits for its longest completions. Whole groups go, so advantages within a group stay
    # unbiased; across prompts it is biased: prompts whose completions are short are kept more often, those with
    # long ones (often the hard ones) less, and a dropped group's prompt is consumed (it comes again in a later
    # epoch). With grpo.dynamic_sampling each round over-provisions so. Not with the vllm backend (it has no such
    # stop) nor over several processes. Metrics: rollout/groups_dropped, rollout/tokens_dropped. 0: off.
    overprovision: float = field(default=0.0, metadata=_check(ge=0))
    # Multi-turn rollouts (qerl/rollout/multi_turn.py; README "Tools and multi-turn rollouts"): the tools the policy
    # may call, as module:function (plain Python functions with type hints and a docstring, called with the keyword
    # arguments of the model's call and returning a str: TRL's tools=[...]). A row stops at its call (the Hermes tag
    # <tool_call>{"name": ..., "arguments": {...}}</tool_call>, Qwen's own; qerl's for templates without one), the tool
    # runs on a thread while the other rows decode, and its answer comes back as a tool turn of the chat template,
    # masked from the loss. [] = single-turn. The engine only (auto, engine, reference), without overprovision.
    tools: list[str] = field(default_factory=list)
    # TRL's environment_factory: module:Factory (or path/to/file.py:Factory), called once per rollout row for an
    # object whose public methods are its tools (beside `tools`), reset with the row's data columns (`reset(**row)`);
    # its state lives for the row, and TRL-form reward functions get the rows' environments as `environments`
    # (README "Tools and multi-turn rollouts"). null: the tools alone, stateless.
    environment: Optional[str] = None
    # Tool calls per completion (TRL's name); the completion ends at the one past it (stop reason stop). None: as
    # many as max_new_tokens holds (the tool turns' tokens count against it).
    max_tool_calling_iterations: Optional[int] = field(default=None, metadata=_check(ge=0))
    # A call's wall time: past it the model gets an error string as the tool's answer and the rollout goes on.
    tool_timeout_s: float = field(default=30.0, metadata=_check(gt=0))
    tool_workers: int = field(default=8, metadata=_check(gt=0))  # tool calls running at once (threads)

    # Completions a step draws (prompts_drawn x group_size) at most: 8x a large run's (DAPO: 512 prompts x 16 =
    # 8,192). Past it a typo's extra zeros sized a Python list of the prompts (2 x 10^11: minutes, then the kernel's
    # OOM kill) before any check of the data could refuse them.
    MAX_COMPLETIONS_PER_STEP = 65_536

    @property
    def prompts_drawn(self) -> int:
        """The prompts a rollout samples: ceil(prompts_per_step * (1 + overprovision)), up to float rounding (so
        that 10 * 1.1 is 11, not 12)."""
        return max(self.prompts_per_step, math.ceil(self.prompts_per_step * (1 + self.overprovision) - 1e-9))

    def validate(self) -> None:
        completions = self.prompts_drawn * self.group_size
        if completions > self.MAX_COMPLETIONS_PER_STEP:  # named by the larger count: the one with the extra zeros
            keys = ("group_size", "prompts_per_step") if self.group_size >= self.prompts_per_step \
                else ("prompts_per_step", "group_size")
            raise _RuleError(keys, f"{keys[0]} = {getattr(self, keys[0])}: {self.prompts_drawn} prompts x "
                             f"{self.group_size} completions = {completions:,} a step, past the "
                             f"{self.MAX_COMPLETIONS_PER_STEP:,} qerl draws in one (a large run draws 512 x 16 = "
                             f"8,192); lower {keys[0]} or {keys[1]}")
        # vLLM's own speculation is prompt-lookup n-grams (no run history, no siblings), and with LoRA enabled it
        # crashed on concurrent requests (vllm-project/vllm#20284, open): a GRPO rollout is nothing but concurrent
        # requests. So `on` is refused there rather than silently ignored; `auto` means the engine's only.
        if self.speculative == "on" and self.backend == "vllm":
            raise _RuleError(("speculative", "backend"), "speculative = 'on': backend 'vllm' has no speculation qerl "
                             "can use with LoRA adapters (vllm-project/vllm#20284); use the engine or set it to off")
        if self.overprovision > 0 and self.backend == "vllm":
            raise _RuleError(("overprovision", "backend"), f"overprovision = {self.overprovision}: backend 'vllm' "
                             "cannot stop a rollout once enough groups are done; use the engine or set it to 0")
        self._validate_tools()

    def _validate_tools(self) -> None:
        """What multi-turn rollouts do not run with yet, refused rather than run wrong."""
        bad = [t for t in self.tools if split_spec(t) is None]
        if bad:
            raise _RuleError("tools", f"tools = {self.tools}: name each as {SHAPE} ({bad[0]!r})")
        if self.environment is not None and split_spec(self.environment) is None:
            raise _RuleError("environment", f"environment = {self.environment!r}: name it as {SHAPE}")
        if not self.tools and self.environment is None:
            return
        key = "tools" if self.tools else "environment"  # what made the rollout multi-turn
        # vLLM's generate runs every request to its end: a row cannot wait there for a tool with its KV cache kept
        # and go on from it, which is what qerl's multi-turn path is (our engine pauses and extends rows).
        if self.backend == "vllm":
            raise _RuleError((key, "backend"), f"{key}: backend 'vllm' cannot pause a row at a tool call and go on "
                             "from its KV cache (qerl's multi-turn path is its own engine's); use backend auto, "
                             "engine or reference")
        if self.overprovision > 0:
            raise _RuleError((key, "overprovision"), f"{key} with overprovision = {self.overprovision}: a group "
                             "cut while rows wait for tools is not supported; set overprovision to 0")
        if self.speculative == "on":  # its drafts would not know the tools' tokens
            raise _RuleError((key, "speculative"), f"{key} with speculative = 'on': multi-turn rows decode without "
                             "speculation; set speculative to off or auto")


# The ratio's clip range where the params leave it unset (null), by importance_sampling_level: DAPO's clip-higher per
# token; the GSPO paper's per sequence (its one ratio per sequence is a mean over tokens: far closer to 1).
CLIP_RANGE = {"token": (0.2, 0.28), "sequence": (3e-4, 4e-4)}
CISPO_CAP = 5.0  # loss_type cispo's epsilon_high, the weight's cap itself, where unset (TRL's and ScaleRL's value)


@dataclass
class GRPOSettings:
    # The surrogate and how it is averaged (qerl.rl.grpo.LossConfig; README "The policy losses"): grpo (per-sequence
    # mean), dapo (per token over the step), dr_grpo (over B x max_new_tokens), bnpo (per token over each
    # micro-batch), cispo (MiniMax-M1: REINFORCE weighted by the ratio capped at epsilon_high, per token over the
    # step), sapo (a sigmoid gate on the ratio instead of the clip, per-sequence mean).
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo"] = "dapo"
    scale_rewards: Literal["group", "batch", "none"] = "group"  # "none" is Dr. GRPO (no division by the std)
    # Clip range [1 - epsilon_low, 1 + epsilon_high] of the ratio; null: CLIP_RANGE of importance_sampling_level
    # (0.2 / 0.28 per token, 3e-4 / 4e-4 per sequence). cispo: epsilon_high is the cap itself (null: 5.0).
    epsilon_low: Optional[float] = field(default=None, metadata=_check(ge=0, lt=1))
    epsilon_high: Optional[float] = field(default=None, metadata=_check(ge=0))
    # token: one ratio per token; sequence: GSPO's one per sequence, exp(mean over its tokens of the log-ratio)
    importance_sampling_level: Literal["token", "sequence"] = "token"
    sapo_temperature_pos: float = field(default=1.0, metadata=_check(gt=0))  # SAPO's gate, tokens with A > 0
    sapo_temperature_neg: float = field(default=1.05, metadata=_check(gt=0))  # and with A <= 0
    beta: float = field(default=0.0, metadata=_check(ge=0))  # KL weight; reference = base with adapters off
    num_iterations: int = field(default=1, metadata=_check(ge=1))  # μ: updates per rollout batch
    # Sequences per forward/backward: gradients accumulate over the micro-batches of a step, one optimizer step per μ
    micro_batch_size: int = field(default=8, metadata=_check(gt=0))
    mask_truncated: bool = False  # drop completions that hit max_new_tokens from the loss
    # DAPO: drop groups with equal rewards and draw more prompts. A step left with none makes no update, and the
    # learning-rate schedule (which counts updates) does not advance.
    dynamic_sampling: bool = False
    max_resample_rounds: int = field(default=3, metadata=_check(ge=0))
    # The rollout-to-trainer correction: a weight exp(trainer logp - sampler logp) per token (correction_level:
    # token) or its product per sequence (sequence); tis truncates it at correction_cap, mis drops the token's (or
    # sequence's) loss beyond it, none applies none. Metrics: tis_weight/mean, tis_weight/truncated or
    # mis_weight/mean, mis_weight/masked (shares of loss tokens), and rollout_logp_gap/mean always. auto: tis where
    # the rollouts and the update compute in different precisions (the NVFP4 base's FP8 weight copies,
    # quant.fp8_weights; the FP8 KV cache; the FP8 update, model.base_gemm), whose log-prob gaps measured over 0.03
    # nats per token (BENCHMARKS.md, 2026-11-27 and -28), none elsewhere (the CPU, bf16 GEMMs on both sides: ~0.02);
    # the trainer says which in one log line.
    correction: Literal["auto", "none", "tis", "mis"] = "auto"
    correction_level: Literal["token", "sequence"] = "token"
    correction_cap: Optional[float] = field(default=None, metadata=_check(gt=0))  # null: tis_cap if set, else 2.0
    # Shorthand kept from before `correction`: tis_cap: C is correction: tis with correction_cap: C
    tis_cap: Optional[float] = field(default=None, metadata=_check(gt=0))
    # The loss only on the tokens whose entropy is in this top quantile of the step's loss tokens (the 80/20 paper:
    # 0.2); 1.0: every token. Below 1 it costs a forward without autograd per step (none when num_iterations > 1).
    top_entropy_quantile: float = field(default=1.0, metadata=_check(ge=0, le=1))

    def __post_init__(self) -> None:
        low, high = CLIP_RANGE.get(self.importance_sampling_level, CLIP_RANGE["token"])  # other levels: refused
        if self.epsilon_low is None:
            self.epsilon_low = low
        if self.epsilon_high is None:
            self.epsilon_high = CISPO_CAP if self.loss_type == "cispo" else high

    def validate(self) -> None:
        if self.loss_type == "cispo" and self.epsilon_high <= 1:
            raise _RuleError(("epsilon_high", "loss_type"), f"epsilon_high = {self.epsilon_high}: loss_type 'cispo' "
                             "caps the importance weight at epsilon_high itself (e.g. 5.0, or null for that); a cap "
                             "<= 1 would down-weight every on-policy token")
        if self.tis_cap is not None and (self.correction == "mis" or self.correction_cap not in (None, self.tis_cap)):
            raise _RuleError(("tis_cap", "correction", "correction_cap"), f"tis_cap = {self.tis_cap} is short for "
                             f"correction: tis, correction_cap: {self.tis_cap}; it contradicts correction = "
                             f"{self.correction!r}, correction_cap = {self.correction_cap}: set one or the other")


@dataclass
class AQNSettings:
    enabled: bool = True
    sigma_start: float = field(default=1e-2, metadata=_check(ge=0))
    sigma_end: float = field(default=5e-4, metadata=_check(ge=0))
    num_stages: int = field(default=10, metadata=_check(ge=1))
    in_training_forward: bool = False  # also perturb the norms during the update's forward
    # Which RMSNorm weights get the noise (fresh draws every step, from aqn.seed and the step): every block's norms
    # that feed q/k/v and gate/up always; the final norm before the LM head (as the paper's code does) unless false;
    # the per-head q_norm/k_norm of families that have them (Qwen3, Gemma3) only if true (the paper's never did).
    include_final_norm: bool = True
    include_qk_norm: bool = False
    seed: int = field(default=0, metadata=_SEED)
    # geometric: the paper's stages (sigma_start -> sigma_end, the first stage noise-free). entropy: sigma starts at
    # sigma_start and is multiplied by sigma_rate after each step whose policy entropy was below target_entropy,
    # divided by it otherwise, within [sigma_min, sigma_max] (qerl.model.aqn.EntropyTargetedSchedule).
    schedule: Literal["geometric", "entropy"] = "geometric"
    target_entropy: Optional[float] = field(default=None, metadata=_check(gt=0))  # nats per completion token
    sigma_min: float = field(default=5e-4, metadata=_check(gt=0))
    sigma_max: float = field(default=5e-2, metadata=_check(gt=0))
    sigma_rate: float = field(default=1.5, metadata=_check(gt=1))

    def validate(self) -> None:
        sigmas = ("sigma_start", "sigma_end")
        if not self.enabled:
            return
        if self.schedule == "entropy":
            if self.target_entropy is None:
                raise _RuleError("target_entropy", "target_entropy = None: schedule 'entropy' needs a target "
                                 "(nats per token, e.g. 0.8)")
            if self.sigma_max < self.sigma_min:
                raise _RuleError("sigma_max", f"sigma_max = {self.sigma_max}: must be >= sigma_min = "
                                 f"{self.sigma_min}")
            if not self.sigma_min <= self.sigma_start <= self.sigma_max:
                raise _RuleError("sigma_start", f"sigma_start = {self.sigma_start}: schedule 'entropy' starts "
                                 f"there, so it must lie in [sigma_min, sigma_max] = [{self.sigma_min}, "
                                 f"{self.sigma_max}]")
            return
        if self.num_stages > 1 and (self.sigma_start <= 0) != (self.sigma_end <= 0):
            raise _RuleError(sigmas, f"sigma_start = {self.sigma_start}, sigma_end = {self.sigma_end}: both must "
                             "be > 0 for a geometric schedule")
        if self.sigma_start < self.sigma_end:  # the geometric schedule decays: a growing one is a typo
            raise _RuleError(sigmas, f"sigma_start = {self.sigma_start} < sigma_end = {self.sigma_end}: the noise "
                             "decays from sigma_start to sigma_end, so sigma_start must be >= sigma_end")


@dataclass
class OptimSettings:
    lr: float = field(default=1e-5, metadata=_check(gt=0))
    weight_decay: float = field(default=0.0, metadata=_check(ge=0))
    beta1: float = field(default=0.9, metadata=_check(ge=0, lt=1))
    beta2: float = field(default=0.99, metadata=_check(ge=0, lt=1))
    eps: float = field(default=1e-8, metadata=_check(gt=0))
    warmup_steps: int = field(default=0, metadata=_check(ge=0))
    schedule: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: float = field(default=0.1, metadata=_check(ge=0, le=1))
    max_grad_norm: float = field(default=1.0, metadata=_check(gt=0))


@dataclass
class TrainSettings:
    steps: int = field(default=100, metadata=_check(gt=0))
    seed: int = field(default=0, metadata=_SEED)
    save_every: int = field(default=25, metadata=_check(gt=0))
    eval_every: int = field(default=0, metadata=_check(ge=0))  # 0 = only at the end (flows)
    out_dir: str = "runs/default"
    rewards: dict[str, float] = field(default_factory=lambda: {"accuracy": 1.0})  # name or module:function -> weight
    # Each function's form where its signature does not say (qerl.data.rewards.reward_form): trl (TRL's batch call,
    # `(prompts, completions, completion_ids, **columns) -> list[float | None]`) or qerl (`(completion, gold)`)
    reward_forms: dict[str, Literal["qerl", "trl"]] = field(default_factory=dict)
    # What TRL-form functions get as prompts and completions, in TRL's dataset formats: conversational (chat
    # messages), standard (text), auto (conversational where prompts go through the tokenizer's chat template)
    reward_format: Literal["auto", "standard", "conversational"] = "auto"
    # Seconds each reward function has per step's batch before the step fails naming it; null: no budget, sync
    # functions then run in the trainer's own thread, as TRL calls them (signal-based timeouts inside them work)
    reward_timeout_s: Optional[float] = field(default=60.0, metadata=_check(gt=0))
    # torchrun runs: how long a collective waits for a rank before the job fails (a dead rank must not hang the rest)
    collective_timeout_s: int = field(default=600, metadata=_check(gt=0))

    def validate(self) -> None:
        if not self.rewards:
            raise _RuleError("rewards", "rewards = {}: name at least one reward function (e.g. accuracy: 1.0)")
        from qerl.data.rewards import reward_terms  # here: a misspelt name fails now, not after the model has loaded

        try:
            reward_terms(self.rewards, self.reward_forms)
        except ValueError as e:
            if str(e).startswith("reward_forms"):  # a declared form, not a function
                raise _RuleError("reward_forms", f"reward_forms = {self.reward_forms}: {e}") from None
            raise _RuleError("rewards", f"rewards = {self.rewards}: {e}") from None


@dataclass
class DataSettings:
    # arithmetic (generated) | a hub dataset id (e.g. openai/gsm8k) | a local jsonl/json/parquet/csv file or a folder
    # of them (read by Hugging Face `datasets`) | gsm8k, math500 (short for their hub ids, or for the file at `path`)
    name: str = "arithmetic"
    path: Optional[str] = None  # a local copy for gsm8k/math500
    config: Optional[str] = None  # the hub dataset's configuration (e.g. main for openai/gsm8k)
    split: str = "train"  # of a hub dataset or folder (a single file is one split)
    question_field: Optional[str] = None  # the question column; None: question, problem or prompt
    answer_field: Optional[str] = None  # the answer column; None: answer or solution
    # how the answer column writes the gold: gsm8k "... #### 42", math "... \boxed{42}", plain "42"; auto: by row 1
    answer_format: Literal["auto", "gsm8k", "math", "plain"] = "auto"
    n: Optional[int] = field(default=2000, metadata=_check(gt=0))  # examples to draw (None = all)
    digits: int = field(default=2, metadata=_check(ge=1, le=12))  # arithmetic task knobs
    operators: str = "+-"
    steps: int = field(default=1, metadata=_check(ge=1, le=8))
    seed: int = field(default=0, metadata=_SEED)
    system_prompt: Optional[str] = None  # None = qerl.data.problems.SYSTEM_PROMPT
    # A prompt longer than the model's context minus max_new_tokens: "error" names its file and line; "drop" leaves
    # such examples out (train and eval) and logs how many.
    overlong_prompts: Literal["error", "drop"] = "error"

    def validate(self) -> None:
        bad = set(self.operators) - set("+-*")
        if not self.operators or bad:
            raise _RuleError("operators", f"operators = {self.operators!r}: use a non-empty subset of '+-*'")


@dataclass
class EvalSettings:
    name: str = "arithmetic"  # same choices as data.name; the arithmetic knobs come from `data`
    path: Optional[str] = None
    config: Optional[str] = None  # config, split and the field keys: as in `data`, for the evaluation set
    split: str = "test"
    question_field: Optional[str] = None
    answer_field: Optional[str] = None
    answer_format: Literal["auto", "gsm8k", "math", "plain"] = "auto"
    n: Optional[int] = field(default=200, metadata=_check(gt=0))
    max_new_tokens: int = field(default=256, metadata=_check(gt=0))
    temperature: float = field(default=0.0, metadata=_check(ge=0))  # 0 = greedy
    top_p: float = field(default=1.0, metadata=_check(gt=0, le=1))
    # k: mean accuracy and pass@k over k samples. At most 4,096 (4x the largest k of pass@k studies, 1,024): 10^9
    # was a MemoryError after the model had loaded.
    num_samples: int = field(default=1, metadata=_check(ge=1, le=4096))
    batch_size: int = field(default=16, metadata=_check(gt=0))
    out_dir: str = "runs/eval"
    seed: int = field(default=0, metadata=_SEED)

    def validate(self) -> None:
        if self.num_samples > 1 and self.temperature == 0:
            raise _RuleError("num_samples", f"num_samples = {self.num_samples}: k > 1 samples need temperature > 0")


@dataclass
class ExecutionSettings:
    """How the model runs on a GPU beyond what `model` and `quant` choose (`qerl.execution` builds the model's plan
    from the three): switches kept for measurements. None changes what is computed beyond kernels' rounding."""

    # LoRA's update added in the Gluon decode GEMM's epilogue instead of one addmm after it. Off: measured slower (H100,
    # 7B: rollouts 0.93-0.77x; BENCHMARKS.md, "Rollouts: the Gluon default and LoRA in the epilogue").
    lora_epilogue: bool = False
    # How each NVFP4 GEMM's backend is picked per (layer shape, M bucket) (kernels/dispatch.py): measure (every
    # candidate timed the first time a key is seen on this machine, the winner cached in
    # ~/.cache/qerl/gemm_dispatch.json), defaults (the shape-generic defaults only: nothing timed or cached).
    gemm_tuning: Literal["measure", "defaults"] = "measure"
    # Our Triton NVFP4 GEMM (the qerl layout): time its candidate launch configs the first time each shape is seen
    # instead of the table tuned on an H200 (kernels/nvfp4.py).
    nvfp4_autotune: bool = False


@dataclass
class TrackingSettings:
    backend: Literal["none", "mlflow"] = "none"
    tracking_uri: Optional[str] = None  # None: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db
    experiment: str = "qerl"
    run_name: Optional[str] = None
    registered_model: str = "qerl-adapter"


@dataclass
class Settings:
    model: ModelSettings = field(default_factory=ModelSettings)
    quant: QuantSettings = field(default_factory=QuantSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    grpo: GRPOSettings = field(default_factory=GRPOSettings)
    aqn: AQNSettings = field(default_factory=AQNSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    data: DataSettings = field(default_factory=DataSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    tracking: TrackingSettings = field(default_factory=TrackingSettings)
    execution: ExecutionSettings = field(default_factory=ExecutionSettings)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_flat_dict(self) -> dict[str, Any]:
        """`{"lora.rank": 16, ...}`: what trackers log as parameters (lists/dicts as JSON strings)."""
        flat = {}
        for section, values in self.to_dict().items():
            for key, value in values.items():
                flat[f"{section}.{key}"] = json.dumps(value) if isinstance(value, (list, dict)) else value
        return flat

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def fingerprint(self, *sections: str) -> str:
        """Stable hash of the named sections (all if none): cache keys for pipeline stages."""
        d = self.to_dict()
        chosen = {s: d[s] for s in (sections or d)}
        return hashlib.sha256(json.dumps(chosen, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------------
# Optional packages that a params value needs
# ---------------------------------------------------------------------------------------------------------------

VLLM_INSTALL = 'pip install "qerl[vllm]" (vllm 0.26, for torch 2.11)'


def needed_extras(settings: Settings) -> list[tuple[str, Any, str, str]]:
    """(key, value, module, install command) of each optional package (pyproject's extras) the settings' values
    need for a run: the rollout backend, the QLoRA base. (MLflow's `tracking.backend` is the flows', which need the
    pipeline extra whole; liger and humming kernels are choices that fall back with a warning.)"""
    from qerl.quant import bnb

    needs = [("rollout.backend", settings.rollout.backend, "vllm", "vllm", VLLM_INSTALL),
             ("quant.scheme", settings.quant.scheme, bnb.SCHEME, "bitsandbytes", bnb.INSTALL_HINT)]
    return [(key, value, module, install) for key, value, wanted, module, install in needs if value == wanted]


def require_extras(settings: Settings) -> None:
    """A `MissingExtra` (exit 2) naming the key and the install command when a package the settings need is not
    installed. Called by the commands that run a model, before it loads (a missing vLLM was found after 9-25 s of
    loading); not when settings load, since `qerl params`, the flows' planning and comparisons read params on
    machines without these packages. Found without importing them (importing vLLM alone takes seconds); an install
    that is present but broken still fails where the package is imported."""
    from qerl.errors import MissingExtra

    for key, value, module, install in needed_extras(settings):
        if not _installed(module):
            raise MissingExtra(f"{key} {value!r} needs {module}, which is not installed: {install}")


def _installed(module: str) -> bool:
    if module in sys.modules:  # (None there: an import that failed, or a test's stand-in for "not installed")
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


# ---------------------------------------------------------------------------------------------------------------
# Loading and validation
# ---------------------------------------------------------------------------------------------------------------


def load_settings(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Settings:
    """Read a params YAML (default: params/default.yaml), apply `section.key=value` overrides, validate."""
    path = Path(path) if path is not None else DEFAULT_PARAMS
    if not path.exists():
        raise ConfigError(f"{path}: params file not found")
    if path.is_dir():
        raise ConfigError(f"{path}: a folder, not a params file (e.g. params/default.yaml)")
    raw, lines = read_params_file(path)
    if raw is None:  # an empty file is a mistake (a truncated copy, the wrong path), not a wish for every default
        raise ConfigError(f"{path}: the params file is empty (no sections); start from params/default.yaml")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(raw).__name__}")
    sources = {key: f"{path}:{line}" for key, line in lines.items()}
    for item in overrides:
        key, value = _parse_override(item)
        _set_path(raw, key, value, source=f"-S {item}")
        sources[key] = f"-S {item}"
    return settings_from_dict(raw, sources=sources, default_source=str(path))


def settings_from_dict(raw: dict, sources: dict[str, str] | None = None, default_source: str = "params") -> Settings:
    """Validate a nested dict into Settings; errors name `sources[key]` (file:line or the -S flag)."""
    return _build(Settings, raw, "", sources or {}, default_source)


def split_overrides(text: str) -> list[str]:
    """`section.key=value,section.key=value` -> its overrides, split at the commas outside a value's brackets and
    quotes, so that a YAML flow value keeps its own (`quant.layer_schemes={"*.down_proj": fp8, "*.v_proj": fp8}`).
    Blank items are dropped."""
    items, depth, quote, start = [], 0, "", 0
    for i, c in enumerate(text):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth = max(0, depth - 1)
        elif c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _parse_override(item: str) -> tuple[str, Any]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip() or "." not in key:
        raise ConfigError(f"-S {item}: expected section.key=value (e.g. -S lora.rank=8)")
    return key.strip(), read_value(value, f"-S {item}") if value.strip() else ""


def _set_path(raw: dict, key: str, value: Any, source: str) -> None:
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: {part} is not a section")
        node = child
    node[leaf] = value


def _where(path: str, sources: dict[str, str], default: str) -> str:
    while path:
        if path in sources:
            return sources[path]
        path = path.rpartition(".")[0]
    return default


def _build(cls: type, raw: Any, at: str, sources: dict[str, str], default: str) -> Any:
    where = _where(at, sources, default)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: {at or 'params'} = {raw!r}: expected a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            path = f"{at}.{key}" if at else str(key)
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(fields)})"
            # an unknown section set only by `-S section.key=v` is known to sources by its full key
            origin = next((src for k, src in sources.items() if k == path or k.startswith(path + ".")), None)
            raise ConfigError(f"{origin or _where(path, sources, default)}: unknown key {shortened(path)}{hint}")
    values = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        path = f"{at}.{name}" if at else name
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, raw[name], path, sources, default)
        else:
            value = _coerce(raw[name], hint, path, _where(path, sources, default))
            _check_bounds(value, f.metadata.get("bounds", {}), path, _where(path, sources, default))
            values[name] = value
    obj = cls(**values)
    if hasattr(obj, "validate"):
        try:
            obj.validate()
        except _RuleError as exc:
            places = [_where(f"{at}.{key}", sources, default) for key in exc.keys]
            where = next((p for p in places if p.startswith("-S ")), places[0])
            raise ConfigError(f"{where}: {at}.{exc}") from None
    return obj


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    return getattr(hint, "__name__", str(hint)).replace("typing.", "")


def _coerce(value: Any, hint: Any, path: str, where: str) -> Any:
    def fail(expected: str) -> typing.NoReturn:
        raise ConfigError(f"{where}: {path} = {shortened(value)}: expected {expected}")

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], path, where)
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            fail(_type_name(hint) + (f" (did you mean {close[0]!r}?)" if close else ""))
        return value
    if origin is list:
        if not isinstance(value, list):
            fail(f"a list of {_type_name(args[0])}")
        return [_coerce(v, args[0], f"{path}[{i}]", where) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            fail(f"a mapping of {_type_name(args[0])} to {_type_name(args[1])}")
        return {_coerce(k, args[0], path, where): _coerce(v, args[1], f"{path}.{k}", where) for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            fail("true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail("an integer")
        return value
    if hint is float:
        if isinstance(value, str) and _FLOAT.match(value.strip()):
            value = float(value)  # YAML 1.1 reads `1e-5` (no dot) as a string; users mean the number
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail("a number")
        if value != value or value in (float("inf"), float("-inf")):
            fail("a finite number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            fail("a string")
        return value
    raise TypeError(f"unsupported settings type {hint!r} at {path}")  # a schema bug, not a user error


def _check_bounds(value: Any, bounds: dict[str, float], path: str, where: str) -> None:
    if value is None or not bounds:
        return
    ops = {"gt": (lambda v, b: v > b, ">"), "ge": (lambda v, b: v >= b, ">="),
           "lt": (lambda v, b: v < b, "<"), "le": (lambda v, b: v <= b, "<=")}
    for name, bound in bounds.items():
        ok, sym = ops[name]
        if not ok(value, bound):
            raise ConfigError(f"{where}: {path} = {value!r}: must be {sym} {bound}")
