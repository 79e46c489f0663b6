"""Quantize a Hugging Face checkpoint folder shard by shard: ``quantize_checkpoint(src, dst, scheme)``.

Every 2-D weight of a linear layer inside the decoder blocks (``*.layers.N.*.weight``; never embeddings,
lm_head or norms) becomes its codec's tensors; everything else is stored in the source's dtype, so a base loaded
from the folder in the run's dtype is the base quantized in memory (``qerl.quant.linear.quantize_model``) bit for
bit: on the CPU (fp32) the embedded SmolLM2's bf16-rounded embeddings gave other replies than `qerl eval`'s
in-memory base. The "bf16" scheme alone writes everything in bf16 (that is what it is for); config.json says
bfloat16, the dtype vLLM and transformers run a 16-bit-activation format in. The output keeps the
source's shard layout. NVFP4, MXFP4 and FP8 folders carry the ``quantization_config`` llm-compressor writes
(compressed-tensors ``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized`` / ``float-quantized`` as FP8_DYNAMIC), so
vLLM, transformers and compressed-tensors load them; NF4 gets a qerl config. Peak memory is about one output shard
plus one tensor, so a 32B model quantizes on a 24 GiB machine.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qerl.quant.formats import Codec, get_codec, scheme_for_compressed_tensors
from qerl.quant.linear import DECODER_LINEAR_PATTERN, fused_group_key
from qerl.run.atomic import atomic_dir, remove_killed_writes
from qerl.run.lock import output_lock

__all__ = ["quantize_checkpoint", "QuantizeReport", "quantization_config", "scheme_from_config",
           "is_quantizable_weight", "COMPRESSED_TENSORS_VERSION"]

log = logging.getLogger(__name__)

# The compressed-tensors release whose serialization our configs reproduce (tests check the layout).
COMPRESSED_TENSORS_VERSION = "0.20.0"
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
_INDEX = "model.safetensors.index.json"


@dataclass
class QuantizeReport:
    """What quantize_checkpoint did: per-layer relative errors, sizes and (optionally) perplexities."""

    src: Path
    dst: Path
    scheme: str
    layer_errors: dict[str, float] = field(default_factory=dict)  # tensor -> ||W - deq(q(W))|| / ||W||
    kept_dense: dict[str, str] = field(default_factory=dict)  # tensor -> why it was not quantized
    bytes_before: int = 0  # all tensors of the source
    bytes_after: int = 0  # all tensors written
    perplexity_before: float | None = None
    perplexity_after: float | None = None

    @property
    def mean_error(self) -> float:
        return sum(self.layer_errors.values()) / max(len(self.layer_errors), 1)

    def summary(self) -> str:
        """A few human-readable lines."""
        lines = [f"{self.src} -> {self.dst} ({self.scheme}): {len(self.layer_errors)} layers quantized, "
                 f"{_fmt_bytes(self.bytes_before)} -> {_fmt_bytes(self.bytes_after)}"]
        if self.layer_errors:
            worst = max(self.layer_errors, key=self.layer_errors.__getitem__)
            lines.append(f"relative weight error: mean {self.mean_error:.4f}, max {self.layer_errors[worst]:.4f} ({worst})")
        if self.kept_dense:
            lines.append(f"kept dense: {', '.join(f'{k} ({v})' for k, v in self.kept_dense.items())}")
        if self.perplexity_before is not None:
            lines.append(f"perplexity: {self.perplexity_before:.3f} -> {self.perplexity_after:.3f}")
        return "\n".join(lines)


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def is_quantizable_weight(name: str, shape: tuple[int, ...] | torch.Size) -> bool:
    """A 2-D linear weight inside a decoder block (not an embedding, lm_head or norm)."""
    return (name.endswith(".weight") and len(shape) == 2 and re.search(DECODER_LINEAR_PATTERN, name) is not None
            and not re.search(r"(embed|lm_head|norm)", name))


def quantization_config(scheme: str, ignore: list[str] | None = None) -> dict[str, Any] | None:
    """The config.json ``quantization_config`` for a scheme (None for bf16).

    nvfp4/mxfp4/fp8: exactly what llm-compressor + compressed-tensors serialize for NVFP4A16 / MXFP4A16 /
    FP8_DYNAMIC (the last with its per-token dynamic input activations: nothing stored, the engine scales them).
    Others: ``{"quant_method": "qerl", "scheme", "block_size", "ignore"}``.
    `ignore`: module names left dense (lm_head is always added).
    """
    codec = get_codec(scheme)
    ignore = ["lm_head", *(n for n in (ignore or []) if n != "lm_head")]
    if codec.scheme == "bf16":
        return None
    if codec.compressed_tensors_format is None:
        return {"quant_method": "qerl", "scheme": codec.scheme, "block_size": codec.block_size, "ignore": ignore}
    fmt = codec.compressed_tensors_format
    return {
        "quant_method": "compressed-tensors",
        "version": COMPRESSED_TENSORS_VERSION,
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(codec.compressed_tensors_weights),
                                      "input_activations": _entry(codec.compressed_tensors_input_activations),
                                      "output_activations": None, "format": fmt}},
        "ignore": ignore,
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "moe_sparsity_config": None,
        "sparsity_config": {},
        "transform_config": {},
    }


def _entry(args: Any) -> dict[str, Any] | None:
    return None if args is None else dict(args)


# What must match between a compressed-tensors config group's "weights" and a codec's for its tensors to be that
# codec's layout: "float-quantized" also holds per-tensor and 128x128-block FP8, whose scales are other shapes.
_LAYOUT_KEYS = ("num_bits", "type", "strategy", "group_size")


def scheme_from_config(quant_config: dict[str, Any] | None) -> str | None:
    """Inverse of quantization_config: the scheme a config.json ``quantization_config`` declares."""
    if not quant_config:
        return None
    if quant_config.get("quant_method") == "qerl":
        return get_codec(quant_config.get("scheme", "")).scheme
    if quant_config.get("quant_method") == "compressed-tensors":
        if (scheme := scheme_for_compressed_tensors(quant_config.get("format"))) is not None:
            ours = get_codec(scheme).compressed_tensors_weights
            for group, entry in (quant_config.get("config_groups") or {}).items():
                weights = (entry or {}).get("weights") or {}
                other = {k: weights.get(k) for k in _LAYOUT_KEYS if k in weights and weights.get(k) != ours.get(k)}
                if other:
                    raise ValueError(f"unsupported quantization_config: format {quant_config.get('format')!r} with "
                                     f"config_groups.{group}.weights {other} (qerl's {scheme} is "
                                     f"{ {k: ours.get(k) for k in other} })")
            return scheme
    raise ValueError(f"unsupported quantization_config: quant_method={quant_config.get('quant_method')!r}, "
                     f"format={quant_config.get('format')!r}")


# ------------------------------------------------------------------------------------------------ reading


def check_shard_names(index: Path, weight_map: dict[str, str]) -> None:
    """`ValueError` naming `index` if a shard it maps to is not named as a file of its own folder:
    `../other/model.safetensors` or an absolute path was read, and a quantization wrote that file's tensors out as
    the folder's own."""
    for shard in weight_map.values():
        if not (isinstance(shard, str) and Path(shard).name == shard and shard not in ("", ".", "..")):
            raise ValueError(f"{index}: shard {shard!r} is not a file of this folder (an index names its shards by "
                             "file name)")


class _Source:
    """A checkpoint folder's shards, opened lazily one tensor at a time."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self._safe_open = safe_open
        self.folder = folder
        if (folder / _INDEX).is_file():
            index = json.loads((folder / _INDEX).read_text())
            self.weight_map: dict[str, str] = index["weight_map"]
            check_shard_names(folder / _INDEX, self.weight_map)  # (commands check the folder first: shard_files)
            self.sharded = True
        elif (folder / "model.safetensors").is_file():
            try:
                with safe_open(folder / "model.safetensors", framework="pt") as f:
                    self.weight_map = dict.fromkeys(f.keys(), "model.safetensors")
            except Exception as e:  # noqa: BLE001 - as below
                raise ValueError(f"{folder / 'model.safetensors'}: cannot read safetensors ({e})") from None
            self.sharded = False
        else:
            found = sorted(p.name for p in folder.iterdir() if p.suffix in _WEIGHT_FILES)
            raise FileNotFoundError(f"{folder}: no model.safetensors or {_INDEX}"
                                    + (f" (found {', '.join(found)}; only safetensors are supported)" if found else ""))
        self.shards = sorted(set(self.weight_map.values()))
        self.shapes: dict[str, tuple[int, ...]] = {}
        for shard in self.shards:
            if not (folder / shard).is_file():
                raise FileNotFoundError(f"{folder / _INDEX} names shard {shard}, which does not exist")
            try:
                with safe_open(folder / shard, framework="pt", device="cpu") as f:
                    self.shapes.update((name, tuple(f.get_slice(name).get_shape())) for name in f.keys())
            except Exception as e:  # noqa: BLE001 - safetensors' own errors (a torn or garbage file) name no file
                raise ValueError(f"{folder / shard}: cannot read safetensors ({e})") from None
        missing = sorted(set(self.weight_map) - set(self.shapes))
        if missing:
            raise ValueError(f"{folder / _INDEX} maps tensor(s) {missing[:5]} to shards that do not contain them")

    def tensors(self, shard: str) -> Iterator[tuple[str, torch.Tensor]]:
        with self._safe_open(self.folder / shard, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)

    def get(self, name: str) -> torch.Tensor:
        with self._safe_open(self.folder / self.weight_map[name], framework="pt", device="cpu") as f:
            return f.get_tensor(name)


class _SharedScales:
    """NVFP4 global scales shared by fused projections (q/k/v, gate/up), computed on first use.

    Members may sit in other shards; each is read once more for its amax (one tensor of extra memory).
    """

    def __init__(self, source: _Source, quantized: set[str], codec: Codec, device: torch.device) -> None:
        self.source, self.codec, self.device = source, codec, device
        self.groups: dict[str, list[str]] = {}
        for name in sorted(quantized):
            if (key := fused_group_key(name)) is not None:
                self.groups.setdefault(key, []).append(name)
        self.scales: dict[str, torch.Tensor] = {}

    def get(self, name: str) -> torch.Tensor | None:
        key = fused_group_key(name)
        if key is None or len(self.groups.get(key, ())) < 2:
            return None
        if key not in self.scales:
            amaxes = [self.codec.tensor_amax(self.source.get(member).to(self.device)) for member in self.groups[key]]
            self.scales[key] = self.codec.global_scale_for(torch.stack(amaxes).amax())
        return self.scales[key]


# ------------------------------------------------------------------------------------------------ writing


def _relative_error(w: torch.Tensor, deq: torch.Tensor) -> float:
    w = w.float()
    norm = w.norm().item()
    return (w - deq).norm().item() / norm if norm > 0 else 0.0


def _temp_prefix(dst: Path) -> str:
    return f".{dst.name}.tmp-"


def _check_destination(src: Path, dst: Path) -> None:
    if dst.resolve() == src.resolve():
        raise ValueError(f"destination {dst} is the source folder")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"destination {dst} already exists and is not an empty folder")


def _quantize_tensor(name: str, w: torch.Tensor, codec: Codec, scales: _SharedScales | None,
                     report: QuantizeReport, strict: bool, device: torch.device) -> dict[str, torch.Tensor]:
    """The CPU tensors to write for one source tensor (quantized if it is a decoder linear weight)."""
    if codec.scheme == "bf16":
        return {name: w.to(torch.bfloat16) if w.is_floating_point() else w}
    # Unquantized tensors as they are (see the module's docstring: bf16 here made a second, different base).
    if not is_quantizable_weight(name, w.shape):
        return {name: w}
    module = name.removesuffix(".weight")
    try:
        codec.check_shape(*w.shape, name=name)
    except ValueError as e:
        if strict:
            raise
        log.warning("%s; keeping it dense", e)
        report.kept_dense[name] = f"in_features {w.shape[1]} not a multiple of {codec.block_size}"
        return {name: w}
    w = w.to(device)
    shared = scales.get(name) if scales is not None else None
    tensors = codec.quantize(w, shared) if shared is not None else codec.quantize(w)
    error = _relative_error(w, codec.dequantize(tensors, torch.float32))
    report.layer_errors[name] = error
    log.debug("%s %s: relative error %.4f", name, list(w.shape), error)  # the summary gives mean and max at INFO
    return {f"{module}.{k}": v.cpu() for k, v in tensors.items()}


# A model folder's Python files (modeling_*.py, tokenization_*.py: the custom code an auto_map names) are never
# copied into a quantization or an export: qerl runs no code from a model folder and passes none on.
CODE_FILES = ("*.py",)


def _copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, generation config, chat template, README...: every top-level non-weight file but code."""
    for path in src.iterdir():
        if not path.is_file() or path.name in ("config.json", _INDEX) or path.suffix in _WEIGHT_FILES:
            continue
        if any(path.match(pattern) for pattern in CODE_FILES):
            log.info("%s: not copied (code: qerl neither runs nor passes on a model folder's code)", path)
            continue
        shutil.copy2(path, dst / path.name)


def _write_config(src: Path, dst: Path, scheme: str, ignore: list[str]) -> None:
    config = json.loads((src / "config.json").read_text())
    qc = quantization_config(scheme, ignore)
    config.pop("quantization_config", None)
    if qc is not None:
        config["quantization_config"] = qc
    # The dtype to run in: 16-bit activations (A16), which compressed-tensors' decompression into transformers
    # needs (an fp32 model fails on its bf16 weights). The tensors it did not quantize keep their own dtype.
    config["dtype" if "dtype" in config else "torch_dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def quantize_checkpoint(
    src: Path | str,
    dst: Path | str,
    scheme: str,
    progress: bool = True,
    strict: bool = False,
    device: torch.device | str | None = None,
) -> QuantizeReport:
    """Write a quantized copy of the Hugging Face folder `src` into `dst` (created atomically).

    Args:
        src: folder with config.json and model.safetensors or sharded safetensors + index.
        dst: output folder; must not exist (or be empty).
        scheme: "nvfp4" (compressed-tensors NVFP4A16), "mxfp4", "nf4", "fp8" (FP8_DYNAMIC) or "bf16".
        progress: tqdm bar over tensors.
        strict: raise instead of keeping dense a linear whose in_features does not fit the block size.
        device: where to quantize (default: CUDA if available, else CPU; results are bit-identical).
    """
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    src, dst = Path(src), Path(dst)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    codec = get_codec(scheme)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src}: no config.json (not a Hugging Face model folder)")
    existing = json.loads((src / "config.json").read_text()).get("quantization_config")
    if existing:
        raise ValueError(f"{src} is already quantized (quantization_config {existing.get('quant_method')!r}, "
                         f"format {existing.get('format', existing.get('scheme'))!r}); quantize a dense checkpoint")
    _check_destination(src, dst)
    source = _Source(src)
    report = QuantizeReport(src=src, dst=dst, scheme=codec.scheme)
    quantized = {n for n, shape in source.shapes.items() if is_quantizable_weight(n, shape)}
    scales = _SharedScales(source, quantized, codec, device) if codec.shares_global_scale else None

    # One writer per destination: under its lock, temp folders beside `dst` are the remains of killed writes.
    lock = output_lock(dst).acquire()
    try:
        remove_killed_writes(dst)
        _check_destination(src, dst)  # again, under the lock: a racing writer may have finished meanwhile
        with atomic_dir(dst, temp_prefix=_temp_prefix(dst)) as tmp:  # replaces an empty dst folder
            weight_map: dict[str, str] = {}
            bar = tqdm(total=len(source.weight_map), desc=f"quantize {codec.scheme}", unit="tensor",
                       disable=not progress)
            for shard in source.shards:
                out: dict[str, torch.Tensor] = {}
                for name, w in source.tensors(shard):
                    report.bytes_before += w.numel() * w.element_size()
                    out.update(_quantize_tensor(name, w, codec, scales, report, strict, device))
                    del w
                    bar.update()
                for name, t in out.items():
                    weight_map[name] = shard
                    report.bytes_after += t.numel() * t.element_size()
                save_file({k: v.contiguous() for k, v in out.items()}, tmp / shard, metadata={"format": "pt"})
                del out
            bar.close()
            if source.sharded:
                index = {"metadata": {"total_size": report.bytes_after},
                         "weight_map": dict(sorted(weight_map.items()))}
                (tmp / _INDEX).write_text(json.dumps(index, indent=2) + "\n")
            _copy_side_files(src, tmp)
            _write_config(src, tmp, codec.scheme, [n.removesuffix(".weight") for n in report.kept_dense])
    finally:
        lock.release()
    log.info("%s", report.summary())
    return report

