"""LoRA adapters on a frozen (possibly NVFP4) base: apply, disable, PEFT-format save/load, merged weights.

Writing a merged model folder (`merge_and_export`) lives in qerl.model.export, next to the checkpoint writer it uses.

Module names follow Hugging Face, so the PEFT key of a LoRA factor is just
`base_model.model.<module name>.lora_A.weight`; adapters saved here load with `peft.PeftModel.from_pretrained`
and adapters saved by PEFT load here.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from qerl.config import LoraSettings  # the one LoRA settings type (also the params file's `lora` section)
from qerl.execution.low_rank import add_low_rank
from qerl.quant.fp8 import frozen_linear
from qerl.run.atomic import atomic_dir

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# qerl's record of a base that exists only quantized at load (quant.layer_schemes, quant.error_correction_rank): what
# an export and an evaluation of this adapter must rebuild. Beside PEFT's two files, which PEFT and vLLM read alone.
BASE_RECORD = "qerl_base.json"
# Frozen copy of a trained RMSNorm weight: `adapters_disabled` must give the true base model (the KL reference).
_NORM_BASE = "lora_base_weight"


def _is_linear(module: nn.Module) -> bool:
    """nn.Linear or a quantized linear (duck-typed, so this module does not depend on qerl.quant)."""
    return isinstance(module, nn.Linear) or (
        hasattr(module, "dequantized_weight") and hasattr(module, "in_features") and hasattr(module, "out_features"))


def _is_rmsnorm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), nn.Parameter)


def _dense_weight(linear: nn.Module, dtype: torch.dtype) -> Tensor:
    if isinstance(linear, nn.Linear):
        return linear.weight.detach().to(dtype)
    return linear.dequantized_weight(dtype).detach()


def _module_device(module: nn.Module) -> torch.device:
    if hasattr(module, "weight_device"):  # a QuantLinear whose weight is a fused layer's rows or a GPU backend's
        return module.weight_device()     # repacked copy holds no tensor of its own
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


class LoraLinear(nn.Module):
    """Frozen base linear + trainable low-rank update: y = base(x) + dropout(x) @ A^T @ B^T * scaling."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False,
                 dtype: torch.dtype | None = None):
        super().__init__()
        if not _is_linear(base):
            raise TypeError(f"LoraLinear needs an nn.Linear or QuantLinear base, got {type(base).__name__}")
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha, self.use_rslora = rank, alpha, use_rslora
        self.scaling = alpha / (math.sqrt(rank) if use_rslora else rank)
        # Default: the base's compute dtype (QuantLinear.dtype is what it dequantizes to), e.g. bf16 as in QeRL.
        dtype = dtype or (base.weight.dtype if isinstance(base, nn.Linear) else getattr(base, "dtype", torch.float32))
        device = _module_device(base)
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, dtype=dtype, device=device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as PEFT (and nn.Linear); B = 0 makes the start exact
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True

    def forward(self, x: Tensor) -> Tensor:
        out = frozen_linear(self.base, x)  # in FP8 inside the FP8 update (model.base_gemm) for a bf16 base
        if not self.enabled:
            return out
        h = self.dropout(x.to(self.lora_A.dtype))
        return add_low_rank(out, nn.functional.linear(h, self.lora_A), self.lora_B, self.scaling)

    def delta_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """(B @ A) * scaling, [out, in]."""
        return (self.lora_B.detach().to(dtype) @ self.lora_A.detach().to(dtype)) * self.scaling

    def merged_weight(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """Base weight (dequantized if quantized) + the LoRA update, computed in fp32 and returned in `dtype`."""
        return (_dense_weight(self.base, torch.float32) + self.delta_weight(torch.float32)).to(dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, scaling={self.scaling:g}"


def lora_layers(model: nn.Module) -> dict[str, LoraLinear]:
    """Every LoraLinear in `model` by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def trained_norms(model: nn.Module) -> dict[str, nn.Module]:
    """RMSNorm modules made trainable by `apply_lora(train_norms=True)`, by module name."""
    return {name: m for name, m in model.named_modules() if hasattr(m, _NORM_BASE)}


def _matches(name: str, targets: tuple[str, ...] | list[str]) -> bool:
    # PEFT's rule for target_modules: the full name or a dotted suffix of it.
    return any(name == t or name.endswith("." + t) for t in targets)


def resolve_targets(model: nn.Module, targets: tuple[str, ...] | list[str]) -> list[str]:
    """target_modules in the model family's own module names, each once: Phi-3 stores q/k/v as one `qkv_proj` and
    gate/up as one `gate_up_proj` (`qerl.model.families`), so there q_proj, k_proj and v_proj all mean qkv_proj, as in
    PEFT adapters of Phi-3. Adapters are saved under the resolved names, which PEFT and vLLM look for."""
    family = getattr(getattr(model, "config", None), "family", None)
    aliases = getattr(family, "lora_target_aliases", {})
    return list(dict.fromkeys(aliases.get(t, t) for t in targets))


def target_layers(model: nn.Module, target_modules: tuple[str, ...] | list[str]) -> list[tuple[str, nn.Module]]:
    """The (name, linear) pairs `target_modules` names (PEFT's matching, the family's aliases); a ValueError if it
    names a module that is no linear, or nothing. Needs only the model's modules, not its weights: a model built on
    the meta device answers before the weights load."""
    names = resolve_targets(model, target_modules)
    targets = [(name, m) for name, m in model.named_modules() if name and _matches(name, names)]
    wrong = [f"{name} ({type(m).__name__})" for name, m in targets if not _is_linear(m)]
    if wrong:
        raise ValueError(f"LoRA target_modules {list(target_modules)} match non-linear modules: "
                         f"{', '.join(wrong[:5])}")
    if not targets:
        leaves = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if _is_linear(m)})
        raise ValueError(f"LoRA target_modules {list(target_modules)} match no module; linear layers are named "
                         f"{leaves}")
    return targets


def apply_lora(model: nn.Module, settings: LoraSettings, dtype: torch.dtype | None = None) -> list[nn.Parameter]:
    """Wrap every linear whose name ends with a target in a LoraLinear, freeze the rest; return trainable params.

    Matching is PEFT's (whole name or dotted suffix), so lm_head / embeddings are only adapted if named.
    `dtype` of the adapters: default the base layer's dtype (a quantized base: the dtype it dequantizes to).
    With `settings.train_norms` every RMSNorm weight also trains (a frozen copy is kept for `adapters_disabled`).
    """
    if lora_layers(model):
        raise ValueError("LoRA is already applied to this model")
    targets = target_layers(model, settings.target_modules)
    _check_rank(settings.rank, targets)
    model.requires_grad_(False)
    trainable: list[nn.Parameter] = []
    for name, base in targets:
        layer = LoraLinear(base, settings.rank, settings.alpha, settings.dropout, settings.use_rslora, dtype)
        model.set_submodule(name, layer)
        trainable += [layer.lora_A, layer.lora_B]
    if settings.train_norms:
        norms = [m for m in model.modules() if _is_rmsnorm(m)]
        if not norms:
            raise ValueError("train_norms=True but the model has no RMSNorm module")
        for norm in norms:
            norm.register_buffer(_NORM_BASE, norm.weight.detach().clone(), persistent=False)
            norm.weight.requires_grad_(True)
            trainable.append(norm.weight)
    return trainable


def _check_rank(rank: int, targets: list[tuple[str, nn.Module]]) -> None:
    """A `ValueError` naming lora.rank if it is past the full rank (the smaller side) of every target layer: such an
    adapter can change no weight more than one of full rank does, and a typo there (10^9 on the embedded model) asked
    torch for terabytes. A rank past some targets' sides only (a GQA model's narrow k_proj and v_proj) is left alone."""
    if not targets:
        return
    name, widest = max(targets, key=lambda t: min(t[1].in_features, t[1].out_features))
    full = min(widest.in_features, widest.out_features)
    if rank > full:
        raise ValueError(f"lora.rank = {rank}: past the full rank of every target layer (at most {full}: {name} is "
                         f"{widest.out_features} x {widest.in_features}), where a LoRA already changes a weight "
                         "freely; lower it")


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run `model` as its frozen base: LoRA off, trained norms back at their base values (the KL reference policy).

    Restores everything on exit, even on error. The norm swap is a pointer swap: no copy, no second model.
    """
    layers, norms = lora_layers(model).values(), trained_norms(model).values()
    was_enabled = [layer.enabled for layer in layers]
    for layer in layers:
        layer.enabled = False
    for norm in norms:
        norm.weight.data, norm.lora_base_weight = norm.lora_base_weight, norm.weight.data
    try:
        yield model
    finally:
        for norm in norms:
            norm.weight.data, norm.lora_base_weight = norm.lora_base_weight, norm.weight.data
        for layer, enabled in zip(layers, was_enabled):
            layer.enabled = enabled


# ---------------------------------------------------------------------------------------------------- PEFT format


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Adapter tensors under PEFT's saved key names (detached, on their device)."""
    state: dict[str, Tensor] = {}
    for name, layer in lora_layers(model).items():
        state[f"{PEFT_PREFIX}{name}.lora_A.weight"] = layer.lora_A.detach()
        state[f"{PEFT_PREFIX}{name}.lora_B.weight"] = layer.lora_B.detach()
    for name, norm in trained_norms(model).items():
        # PEFT saves a modules_to_save copy under the wrapped module's own name (no ".modules_to_save.default").
        state[f"{PEFT_PREFIX}{name}.weight"] = norm.weight.detach()
    return state


def _peft_config(settings: LoraSettings, base_model_name_or_path: str, modules_to_save: list[str] | None) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": sorted(settings.target_modules),
        "use_rslora": settings.use_rslora,
        "bias": "none",
        "modules_to_save": modules_to_save,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "use_dora": False,
        "lora_bias": False,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
        "revision": None,
    }


def _check_settings_match(model: nn.Module, settings: LoraSettings) -> None:
    layers = lora_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA adapters (call apply_lora or load_adapter first)")
    targets = resolve_targets(model, settings.target_modules)
    for name, layer in layers.items():
        if layer.rank != settings.rank or not math.isclose(layer.scaling, settings.scaling):
            raise ValueError(f"settings (rank {settings.rank}, scaling {settings.scaling:g}) disagree with {name} "
                             f"(rank {layer.rank}, scaling {layer.scaling:g})")
        if not _matches(name, targets):
            raise ValueError(f"adapted module {name} is not covered by target_modules {settings.target_modules}")
    if settings.train_norms != bool(trained_norms(model)):
        raise ValueError(f"settings.train_norms={settings.train_norms} but the model "
                         f"{'has' if trained_norms(model) else 'has no'} trained norms")


def save_adapter(model: nn.Module, out_dir: str | os.PathLike, base_model_name_or_path: str,
                 settings: LoraSettings, base_record: dict[str, Any] | None = None) -> Path:
    """Save the adapter in PEFT format (adapter_config.json + adapter_model.safetensors), atomically; return the dir.

    Trained norms are listed in `modules_to_save` by their leaf names (PEFT matches those as name suffixes).
    `base_record`: how the base was quantized at load, where no folder holds it (BASE_RECORD; read_base_record).
    """
    _check_settings_match(model, settings)
    norms = sorted({name.rsplit(".", 1)[-1] for name in trained_norms(model)}) or None
    state = {k: v.to("cpu").contiguous() for k, v in lora_state_dict(model).items()}
    with atomic_dir(out_dir) as tmp:
        save_file(state, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        resolved = replace(settings, target_modules=resolve_targets(model, settings.target_modules))
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(_peft_config(resolved, base_model_name_or_path, norms), indent=2))
        if base_record:
            (tmp / BASE_RECORD).write_text(json.dumps(base_record, indent=2) + "\n")
    return Path(out_dir)


def read_base_record(adapter_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The adapter's BASE_RECORD (None where it has none: its base is a plain one-scheme base)."""
    path = Path(adapter_dir) / BASE_RECORD
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None


def _settings_from_peft(config: Any, path: Path) -> LoraSettings:
    """The LoRA settings an adapter_config.json holds, or a `ValueError` naming `path`: what was not a LoRA config
    failed as an AttributeError, KeyError or TypeError (exit 1, no file named; in a checkpoint the run then could
    not fall back to the one before)."""
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object (a PEFT adapter config), got {type(config).__name__}")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r} is not 'LORA'")
    unsupported = {"use_dora": False, "fan_in_fan_out": False, "lora_bias": False, "bias": "none",
                   "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}
    for key, ok in unsupported.items():
        if config.get(key) not in (ok, None):
            raise ValueError(f"{path}: unsupported adapter option {key}={config[key]!r} (supported: {ok!r})")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        raise ValueError(f"{path}: target_modules as a regex ({targets!r}) is not supported; give a list of names")
    if targets is not None and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise ValueError(f"{path}: target_modules = {targets!r:.40}: expected a list of module names")
    if "r" not in config:
        raise ValueError(f"{path}: no 'r' (the LoRA rank)")
    rank = config["r"]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise ValueError(f"{path}: r = {rank!r:.40}: expected a positive integer")
    numbers = {key: config.get(key, default) for key, default in (("lora_alpha", 8), ("lora_dropout", 0.0))}
    for key, value in numbers.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{path}: {key} = {value!r:.40}: expected a number")
    try:  # its own bounds (alpha > 0, dropout in [0, 1))
        return LoraSettings(rank=rank, alpha=float(numbers["lora_alpha"]), dropout=float(numbers["lora_dropout"]),
                            target_modules=tuple(targets or ()), use_rslora=bool(config.get("use_rslora", False)),
                            train_norms=bool(config.get("modules_to_save")))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def read_adapter_config(adapter_dir: str | os.PathLike) -> tuple[dict[str, Any], LoraSettings]:
    """The adapter folder's PEFT config and its LoRA settings, after checking that both adapter files are there.

    Cheap (no tensors read): callers run it before loading a model, so a wrong path fails in a second.
    """
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise FileNotFoundError(f"adapter folder {adapter_dir} does not exist")
    for fname in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (adapter_dir / fname).is_file():
            raise FileNotFoundError(f"{adapter_dir} has no {fname} (not a PEFT adapter folder)")
    try:
        config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except ValueError as e:  # JSON or UTF-8
        raise ValueError(f"{adapter_dir / ADAPTER_CONFIG}: not a readable JSON file ({e})") from None
    return config, _settings_from_peft(config, adapter_dir / ADAPTER_CONFIG)


def load_adapter(model: nn.Module, adapter_dir: str | os.PathLike, dtype: torch.dtype | None = None) -> LoraSettings:
    """Load a PEFT LoRA adapter into `model` (applying LoRA from its adapter_config.json if not yet applied).

    Raises ValueError naming missing or unexpected tensors and shape mismatches (LoRA applied by this call then
    stays applied, with fresh adapters). Returns the adapter's settings.
    """
    adapter_dir = Path(adapter_dir)
    settings, loaded, expected = _fitting_adapter(model, adapter_dir, dtype)
    with torch.no_grad():  # trained norms keep their pre-load base copy: adapters_disabled stays the base model
        for key, target in expected.items():
            target.copy_(loaded[key])
    return settings


def check_adapter(model: nn.Module, adapter_dir: str | os.PathLike) -> None:
    """Raise what `load_adapter` would (a ValueError naming the file) if the adapter does not fit `model`, whose LoRA
    is already applied; changes nothing."""
    _fitting_adapter(model, Path(adapter_dir))


def _fitting_adapter(model: nn.Module, adapter_dir: Path, dtype: torch.dtype | None = None
                     ) -> tuple[LoraSettings, dict[str, Tensor], dict[str, Tensor]]:
    """The adapter's settings, its tensors and the model's LoRA tensors they go into, once both are known to fit
    (LoRA is applied from the adapter's config if the model has none yet)."""
    config, settings = read_adapter_config(adapter_dir)
    if settings.train_norms:  # PEFT matches modules_to_save as plain name suffixes
        other = [n for n, m in model.named_modules()
                 if n and not _is_rmsnorm(m) and any(n.endswith(t) for t in config["modules_to_save"])]
        if other:
            raise ValueError(f"{adapter_dir}: modules_to_save {config['modules_to_save']} names non-RMSNorm modules "
                             f"({', '.join(other[:5])}); only RMSNorm weights are supported")
    try:  # the adapter's config says a shape that does not fit (another, or a rank past every layer's): name it
        if not lora_layers(model):
            apply_lora(model, settings, dtype)
        else:
            _check_settings_match(model, settings)
    except ValueError as e:
        raise ValueError(f"{adapter_dir / ADAPTER_CONFIG}: {e}") from None

    try:
        loaded = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for truncated or garbage files
        raise ValueError(f"{adapter_dir / ADAPTER_WEIGHTS}: cannot read safetensors ({e})") from None
    expected = lora_state_dict(model)
    missing, unexpected = sorted(expected.keys() - loaded.keys()), sorted(loaded.keys() - expected.keys())
    shapes = [f"{k}: file {tuple(loaded[k].shape)} vs model {tuple(v.shape)}"
              for k, v in expected.items() if k in loaded and loaded[k].shape != v.shape]
    problems = [f"{label} ({len(keys)}): {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"
                for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes))
                if keys]
    if problems:
        raise ValueError(f"adapter {adapter_dir} does not fit the model: " + "; ".join(problems))
    # Shapes fit, but a NaN or infinite weight makes every logit of the adapted model NaN (a resumed run's rollouts,
    # an evaluation's answers): the file is at fault, not the model. One pass over the adapter's small tensors.
    broken = next((k for k, v in loaded.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())), None)
    if broken is not None:
        raise ValueError(f"{adapter_dir / ADAPTER_WEIGHTS}: {broken} holds values that are not finite (NaN or "
                         "infinity)")
    return settings, loaded, expected


# ---------------------------------------------------------------------------------------------------- merge


def _replaced_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Outermost LoraLinear / quantized linears: their state-dict entries become one dense `<name>.weight`."""
    out: dict[str, nn.Module] = {}
    for name, m in model.named_modules():
        if (isinstance(m, LoraLinear) or (_is_linear(m) and not isinstance(m, nn.Linear))) \
                and not any(name.startswith(p + ".") for p in out):
            out[name] = m
    return out


def merged_state_dict(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, Tensor]]:
    """Yield (HF name, CPU tensor) with LoRA merged into the weights and quantized bases dequantized.

    One tensor at a time, so a 32B export never holds a second copy of the model on the GPU.
    Tied weights are yielded once (under the first name), as transformers expects.
    """
    replaced = _replaced_modules(model)
    done: set[str] = set()
    seen_storage: set[int] = set()
    for key, value in model.state_dict(keep_vars=True).items():
        owner = next((p for p in replaced if key.startswith(p + ".")), None)
        if owner is not None:
            if owner in done:
                continue
            done.add(owner)
            module = replaced[owner]
            base = module.base if isinstance(module, LoraLinear) else module
            weight = module.merged_weight(dtype) if isinstance(module, LoraLinear) else _dense_weight(module, dtype)
            yield f"{owner}.weight", weight.cpu().contiguous()
            if getattr(base, "bias", None) is not None:
                yield f"{owner}.bias", base.bias.detach().to(dtype).cpu().contiguous()
            continue
        ptr = value.untyped_storage().data_ptr()
        if ptr in seen_storage:  # tied (e.g. lm_head = embed_tokens)
            continue
        seen_storage.add(ptr)
        value = value.detach()
        yield key, (value.to(dtype) if value.is_floating_point() else value).cpu().contiguous()
