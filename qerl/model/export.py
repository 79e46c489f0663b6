"""`qerl export`: the trained policy as folders vLLM and transformers load, with the commands written next to them.

Two forms:
- unmerged (default): `base/`, the frozen base exactly as trained on (NVFP4 by default, compressed-tensors), and
  `adapter/`, the PEFT LoRA adapter. This is the policy itself, bit for bit: vLLM serves it with `--enable-lora`.
- merged (`--merge`): one model folder with the LoRA merged into the dequantized base and the result quantized again
  to the base's scheme. Simpler to serve, but the re-quantization rounds the merged weights to the base format's grid
  (4-bit, or FP8's), which can undo part of a small LoRA update: it approximates the policy.
Each export gets a README.md with the exact `vllm serve` command and a transformers loading snippet. Every path
written into an export is relative to its folder (the commands run from there), so it can be moved or copied.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from qerl.model import lora
from qerl.model.loading import convert_gguf, quant_scheme, read_config, resolve_model
from qerl.model.transformer import ModelConfig, Transformer
from qerl.quant.checkpoint import CODE_FILES, quantize_checkpoint
from qerl.quant.formats import SERVABLE_SCHEMES, get_codec
from qerl.run.atomic import atomic_dir, remove_killed_writes
from qerl.run.lock import output_lock

log = logging.getLogger(__name__)

# vLLM accepts these values of --max-lora-rank; the command names the smallest that holds the adapter's rank.
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
BASE, ADAPTER = "base", "adapter"  # the unmerged export's two folders


@dataclass
class Export:
    out: Path
    merged: bool
    scheme: str
    vllm_command: str


def export_policy(adapter: str | os.PathLike, out: str | os.PathLike, merge: bool = False,
                  model: str | None = None, scheme: str | None = None) -> Export:
    """Export base + adapter (or the merged model) into the new folder `out`; return what was written.

    `model`: the base checkpoint (default: the adapter's `base_model_name_or_path`, as PEFT does). `scheme`: the
    base's format during training (default: the base folder's own if it is quantized, else nvfp4); the unmerged
    base is written in it and the merged model re-quantized to it.
    """
    adapter, out = Path(adapter), Path(out)
    config = _adapter_config(adapter)
    source = _base_source(model or config.get("base_model_name_or_path"), given=model is not None)
    stored = quant_scheme(read_config(source), source) if source.is_dir() else None
    trained = lora.read_base_record(adapter)  # a base quantized at load only (per-layer schemes, error correction)
    if trained is not None and not merge:
        raise ValueError(f"--adapter {adapter} trained on a base with quant.layer_schemes or error_correction_rank "
                         f"({lora.BASE_RECORD}), which a one-scheme base folder cannot hold: export with --merge (the "
                         "correction folds into the merged weights)")
    scheme = _scheme(scheme or (trained or {}).get("scheme"), stored)
    _check_out_free(out)
    _check_adapter_fits(source, adapter)  # before any slow work: a wrong adapter fails in a second

    out.parent.mkdir(parents=True, exist_ok=True)
    # One writer per destination: under its lock, temp folders beside `out` are the remains of killed exports.
    with output_lock(out):
        remove_killed_writes(out)
        _check_out_free(out)  # again, under the lock: a racing export may have finished meanwhile
        work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            folder = work / "export"
            # Every path written into the export is relative to its folder (its commands run from there), so it
            # can be moved or copied to the machine that serves it: an absolute path named this machine's folders.
            if merge:
                _write_merged(source, adapter, scheme, folder, trained)
                command = f"vllm serve . --served-model-name {_served_name(out)}"
            else:
                _write_unmerged(source, stored, adapter, scheme, folder)
                rank = int(config["r"])
                max_rank = next((r for r in VLLM_LORA_RANKS if r >= rank), rank)
                command = (f"vllm serve ./{BASE} --enable-lora --lora-modules {_served_name(out)}=./{ADAPTER} "
                           f"--max-lora-rank {max_rank}")
            (folder / "README.md").write_text(_readme(merge, scheme, command, config, _served_name(out)))
            os.replace(folder, out)  # an empty `out` is replaced; nothing half-written is ever visible there
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if not merge and config.get("modules_to_save"):
        log.warning("the adapter also trains %s (PEFT modules_to_save), which vLLM's LoRA does not load: serve the "
                    "--merge export with vLLM; transformers + PEFT load this one", config["modules_to_save"])
    log.info("exported to %s", out)
    return Export(out, merge, scheme, command)


def _check_out_free(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} already exists and is not empty; choose another folder or remove it")


def _adapter_config(adapter: Path) -> dict:
    if not adapter.is_dir():
        what = "is a file, not" if adapter.exists() else "does not exist: give"
        raise FileNotFoundError(f"--adapter {adapter} {what} a PEFT adapter folder (e.g. runs/default/adapter)")
    for name in (lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS):
        if not (adapter / name).is_file():
            raise FileNotFoundError(f"--adapter {adapter} has no {name} (not a PEFT adapter folder)")
    try:
        return json.loads((adapter / lora.ADAPTER_CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{adapter / lora.ADAPTER_CONFIG}: invalid JSON ({e})") from None


def _base_source(base: str | None, given: bool) -> Path:
    """The base checkpoint as a path (the embedded alias resolved)."""
    if not base:
        raise ValueError("the adapter names no base (adapter_config.json has no base_model_name_or_path): pass --model")
    try:
        return resolve_model(base)
    except FileNotFoundError:
        if given:
            raise
        raise FileNotFoundError(f"the adapter's base {base!r} (adapter_config.json base_model_name_or_path) does not "
                                f"exist here: pass --model with the base checkpoint") from None


def _scheme(requested: str | None, stored: str | None) -> str:
    if stored is not None and requested not in (None, stored):
        raise ValueError(f"the base is already quantized to {stored}: --scheme {requested} does not apply "
                         "(pass the unquantized checkpoint as --model to export another scheme)")
    scheme = requested or stored or "nvfp4"
    if scheme not in SERVABLE_SCHEMES:
        raise ValueError(f"--scheme {scheme}: neither vLLM nor transformers reads it; use one of "
                         f"{', '.join(SERVABLE_SCHEMES)}")
    return scheme


def _check_adapter_fits(source: Path, adapter: Path) -> None:
    """Load the adapter into the base's architecture built on the meta device: names and shapes are checked
    exactly as for the real model, with no weights read (a 32B base checks in a second)."""
    if source.is_file():  # a GGUF file: its config is in the file
        from qerl.model.loading import read_gguf

        config = read_gguf(source)[0]
    else:
        config = ModelConfig.from_hf(read_config(source))
    net = Transformer.from_config(config, dtype=torch.float32, device="meta")
    try:
        lora.load_adapter(net, adapter)
    except ValueError as e:
        raise ValueError(f"the adapter does not match the base {source}: {e}") from None


def _dense_folder(source: Path, work: Path) -> Path:
    """A Hugging Face folder of the source (a GGUF file is converted first)."""
    if source.is_file():
        return convert_gguf(source, work / "converted")
    return source


def _write_unmerged(source: Path, stored: str | None, adapter: Path, scheme: str, folder: Path) -> None:
    folder.mkdir()
    if stored is not None:  # already the quantized base the adapter trained on: copy it as it is
        shutil.copytree(source, folder / BASE, ignore=shutil.ignore_patterns(*CODE_FILES))
    else:  # the same codes `quantize_model` gives in memory at training time
        quantize_checkpoint(_dense_folder(source, folder.parent), folder / BASE, scheme, progress=False)
    (folder / ADAPTER).mkdir()
    shutil.copy2(adapter / lora.ADAPTER_WEIGHTS, folder / ADAPTER / lora.ADAPTER_WEIGHTS)
    config = json.loads((adapter / lora.ADAPTER_CONFIG).read_text())
    # AutoPeftModelForCausalLM finds the base from here, relative to where it runs: the export's folder, as the
    # README's commands (an absolute path named this machine's folder)
    config["base_model_name_or_path"] = f"./{BASE}"
    (folder / "adapter" / lora.ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def _write_merged(source: Path, adapter: Path, scheme: str, folder: Path, trained: dict | None = None) -> None:
    """`trained`: the adapter's record of a base quantized at load only (lora.read_base_record), rebuilt here as
    training built it; the merged weights then hold its error correction too (QuantLinear.dequantized_weight)."""
    from qerl.model.loading import load_model
    from qerl.quant.linear import QuantLinear, quantize_model

    model, tokenizer = load_model(source)
    if trained is not None:
        quantize_model(model, trained["scheme"], layer_schemes=dict(trained["layer_schemes"]),
                       correction_rank=trained["error_correction_rank"])
    elif scheme != "bf16" and not any(isinstance(m, QuantLinear) for m in model.modules()):
        quantize_model(model, scheme)  # the base the policy trained on: LoRA merges into these weights
    lora.load_adapter(model, adapter)
    base_config = read_config(source) if source.is_dir() else None
    merge_and_export(model, tokenizer, folder, scheme=scheme, base_config=base_config)
    generation = source / "generation_config.json" if source.is_dir() else None
    if generation is not None and generation.is_file():  # vLLM takes its default sampling settings from it
        shutil.copy2(generation, folder / generation.name)


def _write_safetensors(tensors: Iterator[tuple[str, Tensor]], out_dir: Path, max_shard_bytes: int) -> None:
    """model.safetensors, or HF-style shards + model.safetensors.index.json when larger than `max_shard_bytes`."""
    shards: list[dict[str, Tensor]] = [{}]
    sizes = [0]
    files: list[Path] = []

    def flush() -> None:
        path = out_dir / f"shard-{len(files):05d}.tmp"
        save_file(shards[-1], str(path), metadata={"format": "pt"})
        files.append(path)
        shards[-1] = {}

    weight_map: dict[str, int] = {}
    total = 0
    for key, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and sizes[-1] + nbytes > max_shard_bytes:
            flush()
            sizes.append(0)
        shards[-1][key], sizes[-1] = t, sizes[-1] + nbytes
        weight_map[key], total = len(files), total + nbytes
    flush()
    if len(files) == 1:
        os.replace(files[0], out_dir / "model.safetensors")
        return
    names = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    for path, name in zip(files, names):
        os.replace(path, out_dir / name)
    index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for k, i in weight_map.items()}}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _hf_config(model: nn.Module, base_config: dict | None) -> dict[str, Any]:
    if base_config is None:
        config = getattr(model, "config", None)
        if hasattr(config, "to_hf"):
            base_config = config.to_hf()
        elif hasattr(config, "to_dict"):
            base_config = config.to_dict()
        else:
            raise ValueError("merge_and_export: the model has no HF-convertible `config`; pass base_config "
                             "(the base model's config.json as a dict)")
    config = dict(base_config)
    config.pop("quantization_config", None)  # the export is dense; re-quantization writes its own
    config.pop("dtype", None)
    config["torch_dtype"] = "bfloat16"
    return config


def merge_and_export(model: nn.Module, tokenizer: Any, out_dir: str | os.PathLike, scheme: str = "bf16",
                     base_config: dict | None = None, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write a Hugging Face folder with LoRA merged in: config.json, safetensors weights, tokenizer files.

    scheme "bf16": dense bf16 (loads in transformers and our loader). Any other scheme (e.g. "nvfp4") re-quantizes
    the bf16 export through `qerl.quant.checkpoint.quantize_checkpoint`. `base_config` (the base config.json dict)
    defaults to `model.config`. `tokenizer` may be None (no tokenizer files). Atomic: `out_dir` is replaced only
    when complete.
    """
    scheme = get_codec(scheme).scheme  # unknown scheme: a clear error before any work
    config = _hf_config(model, base_config)
    with atomic_dir(out_dir) as tmp:
        bf16_dir = tmp if scheme == "bf16" else Path(tempfile.mkdtemp(prefix=".bf16-", dir=tmp.parent))
        try:
            with torch.no_grad():
                _write_safetensors(lora.merged_state_dict(model, torch.bfloat16), bf16_dir, max_shard_bytes)
            (bf16_dir / "config.json").write_text(json.dumps(config, indent=2))
            if tokenizer is not None:
                tokenizer.save_pretrained(str(bf16_dir))
            if scheme != "bf16":
                quantize_checkpoint(bf16_dir, tmp, scheme)
        finally:
            if bf16_dir != tmp:
                shutil.rmtree(bf16_dir, ignore_errors=True)
    return Path(out_dir)


def _served_name(out: Path) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in out.resolve().name) or "qerl"


def _readme(merged: bool, scheme: str, command: str, config: dict, served_name: str) -> str:
    model_dir = "." if merged else f"./{BASE}"
    ct_format = get_codec(scheme).compressed_tensors_format
    fmt = f"{scheme.upper()} (compressed-tensors `{ct_format}`)" if ct_format else scheme
    load = (f'AutoModelForCausalLM.from_pretrained(\n    "{model_dir}",\n'
            f'    quantization_config=CompressedTensorsConfig(dequantize=True),  # {scheme} -> bf16 nn.Linear\n)'
            if scheme != "bf16" else f'AutoModelForCausalLM.from_pretrained("{model_dir}", dtype=torch.bfloat16)')
    imports = "from transformers import AutoModelForCausalLM, AutoTokenizer" + (
        ", CompressedTensorsConfig" if scheme != "bf16" else "")
    lines = ["import torch"] + ([] if merged else ["from peft import PeftModel"]) + [imports]
    lines += ["", f'tokenizer = AutoTokenizer.from_pretrained("{model_dir}")', f"model = {load}"]
    if not merged:
        lines.append(f'model = PeftModel.from_pretrained(model, "./{ADAPTER}")  # LoRA unmerged, as trained')
    lines += [
        "model.eval()",
        "",
        "# Use the system prompt the policy was trained with (data.system_prompt), if any.",
        'messages = [{"role": "user", "content": "What is 17 + 25?"}]',
        "inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\",",
        "                                       return_dict=True)",
        "with torch.no_grad():",
        "    output = model.generate(**inputs, max_new_tokens=32, do_sample=False)",
        'print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))',
    ]
    snippet = "\n".join(lines)
    if merged:
        what = (f"The policy with its LoRA merged into the base and quantized again to {fmt}. The re-quantization "
                f"rounds the merged weights to the {scheme} grid, so this approximates the trained policy; the "
                "unmerged export (`qerl export` without `--merge`) is exact." if scheme != "bf16"
                else "The policy with its LoRA merged into the bf16 base (dense bf16).")
        layout = "This folder is a Hugging Face model folder (config.json, safetensors, tokenizer)."
    else:
        targets = ", ".join(config.get("target_modules") or [])
        what = (f"The frozen base exactly as trained on, in {fmt}, and the LoRA adapter in PEFT format (rank "
                f"{config.get('r')}, alpha {config.get('lora_alpha')}, on {targets}): together they are the trained "
                "policy, bit for bit.")
        layout = f"- `{BASE}/`: the Hugging Face model folder of the base\n- `{ADAPTER}/`: the PEFT LoRA adapter"
        if config.get("modules_to_save"):
            layout += (f"\n\n**Note:** the adapter also trains {', '.join(config['modules_to_save'])} (PEFT "
                       "`modules_to_save`), which vLLM's LoRA support does not load: serve the `--merge` export with "
                       "vLLM. transformers + PEFT load this one as it is.")
    requests = ("" if merged else f'\n\nRequests name the adapter as the model (`"model": "{served_name}"`); the base '
                "alone stays available under its path.")
    where = ("Every path below is relative to this folder: run the commands from it (`cd` here first), wherever the "
             "folder was moved or copied.")
    return (f"# Exported by `qerl export`\n\n{what}\n\n{layout}\n\n{where}\n\n## Serve with vLLM\n\n"
            f"```bash\n{command}\n```"
            f"{requests}\n\n## Load with transformers{'' if merged else ' + PEFT'}\n\n```python\n{snippet}\n```\n")
