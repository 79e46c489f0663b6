"""`qerl export`: the trained policy as folders vLLM and transformers load, with the commands written next to them.

Two forms:
- unmerged (default): `base/`, the frozen base exactly as trained on (NVFP4 by default, compressed-tensors), and
  `adapter/`, the PEFT LoRA adapter. This is the policy itself, bit for bit: vLLM serves it with `--enable-lora`.
- merged (`--merge`): one model folder with the LoRA merged into the dequantized base and the result quantized again
  to the base's scheme. Simpler to serve, but the re-quantization rounds the merged weights to the 4-bit grid, which
  can undo part of a small LoRA update: it approximates the policy.
Each export gets a README.md with the exact `vllm serve` command and a transformers loading snippet.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from qerl import lora
from qerl.loading import convert_gguf, quant_scheme, read_config, resolve_model
from qerl.model import ModelConfig, Transformer

log = logging.getLogger(__name__)

# Schemes both vLLM and transformers read (compressed-tensors or dense); nf4 is qerl's own format.
SERVABLE_SCHEMES = ("nvfp4", "mxfp4", "bf16")
# vLLM accepts these values of --max-lora-rank; the command names the smallest that holds the adapter's rank.
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


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
    scheme = _scheme(scheme, stored)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} already exists and is not empty; choose another folder or remove it")
    _check_adapter_fits(source, adapter)  # before any slow work: a wrong adapter fails in a second

    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        folder = work / "export"
        if merge:
            _write_merged(source, adapter, scheme, folder)
            command = f"vllm serve {out.resolve()}"
        else:
            _write_unmerged(source, stored, adapter, scheme, folder, out.resolve())
            rank = int(config["r"])
            max_rank = next((r for r in VLLM_LORA_RANKS if r >= rank), rank)
            command = (f"vllm serve {out.resolve() / 'base'} --enable-lora --lora-modules "
                       f"{_served_name(out)}={out.resolve() / 'adapter'} --max-lora-rank {max_rank}")
        (folder / "README.md").write_text(_readme(out.resolve(), merge, scheme, command, config, _served_name(out)))
        os.replace(folder, out)  # an empty `out` is replaced; nothing half-written is ever visible there
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not merge and config.get("modules_to_save"):
        log.warning("the adapter also trains %s (PEFT modules_to_save), which vLLM's LoRA does not load: serve the "
                    "--merge export with vLLM; transformers + PEFT load this one", config["modules_to_save"])
    log.info("exported to %s", out)
    return Export(out, merge, scheme, command)


def _adapter_config(adapter: Path) -> dict:
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
        from qerl.loading import read_gguf

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


def _write_unmerged(source: Path, stored: str | None, adapter: Path, scheme: str, folder: Path, final: Path) -> None:
    from qerl.quant.checkpoint import quantize_checkpoint

    folder.mkdir()
    if stored is not None:  # already the quantized base the adapter trained on: copy it as it is
        shutil.copytree(source, folder / "base")
    else:  # the same codes `quantize_model` gives in memory at training time
        quantize_checkpoint(_dense_folder(source, folder.parent), folder / "base", scheme, progress=False)
    (folder / "adapter").mkdir()
    shutil.copy2(adapter / lora.ADAPTER_WEIGHTS, folder / "adapter" / lora.ADAPTER_WEIGHTS)
    config = json.loads((adapter / lora.ADAPTER_CONFIG).read_text())
    config["base_model_name_or_path"] = str(final / "base")  # AutoPeftModelForCausalLM finds the base from here
    (folder / "adapter" / lora.ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def _write_merged(source: Path, adapter: Path, scheme: str, folder: Path) -> None:
    from qerl.loading import load_model
    from qerl.quant.linear import QuantLinear, quantize_model

    model, tokenizer = load_model(source)
    if scheme != "bf16" and not any(isinstance(m, QuantLinear) for m in model.modules()):
        quantize_model(model, scheme)  # the base the policy trained on: LoRA merges into these weights
    lora.load_adapter(model, adapter)
    base_config = read_config(source) if source.is_dir() else None
    lora.merge_and_export(model, tokenizer, folder, scheme=scheme, base_config=base_config)
    generation = source / "generation_config.json" if source.is_dir() else None
    if generation is not None and generation.is_file():  # vLLM takes its default sampling settings from it
        shutil.copy2(generation, folder / generation.name)


def _served_name(out: Path) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in out.resolve().name) or "qerl"


def _readme(out: Path, merged: bool, scheme: str, command: str, config: dict, served_name: str) -> str:
    model_dir = out if merged else out / "base"
    fmt = {"nvfp4": "NVFP4 (compressed-tensors `nvfp4-pack-quantized`)",
           "mxfp4": "MXFP4 (compressed-tensors `mxfp4-pack-quantized`)", "bf16": "bf16"}[scheme]
    load = (f'AutoModelForCausalLM.from_pretrained(\n    "{model_dir}",\n'
            '    quantization_config=CompressedTensorsConfig(dequantize=True),  # 4-bit weights -> bf16 nn.Linear\n)'
            if scheme != "bf16" else f'AutoModelForCausalLM.from_pretrained("{model_dir}", dtype=torch.bfloat16)')
    imports = "from transformers import AutoModelForCausalLM, AutoTokenizer" + (
        ", CompressedTensorsConfig" if scheme != "bf16" else "")
    lines = ["import torch"] + ([] if merged else ["from peft import PeftModel"]) + [imports]
    lines += ["", f'tokenizer = AutoTokenizer.from_pretrained("{model_dir}")', f"model = {load}"]
    if not merged:
        lines.append(f'model = PeftModel.from_pretrained(model, "{out / "adapter"}")  # LoRA unmerged, as trained')
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
                "rounds the merged weights to the 4-bit grid, so this approximates the trained policy; the unmerged "
                "export (`qerl export` without `--merge`) is exact." if scheme != "bf16"
                else "The policy with its LoRA merged into the bf16 base (dense bf16).")
        layout = "This folder is a Hugging Face model folder (config.json, safetensors, tokenizer)."
    else:
        targets = ", ".join(config.get("target_modules") or [])
        what = (f"The frozen base exactly as trained on, in {fmt}, and the LoRA adapter in PEFT format (rank "
                f"{config.get('r')}, alpha {config.get('lora_alpha')}, on {targets}): together they are the trained "
                "policy, bit for bit.")
        layout = "- `base/`: the Hugging Face model folder of the base\n- `adapter/`: the PEFT LoRA adapter"
        if config.get("modules_to_save"):
            layout += (f"\n\n**Note:** the adapter also trains {', '.join(config['modules_to_save'])} (PEFT "
                       "`modules_to_save`), which vLLM's LoRA support does not load: serve the `--merge` export with "
                       "vLLM. transformers + PEFT load this one as it is.")
    requests = ("" if merged else f'\n\nRequests name the adapter as the model (`"model": "{served_name}"`); the base '
                "alone stays available under its path.")
    return (f"# Exported by `qerl export`\n\n{what}\n\n{layout}\n\n## Serve with vLLM\n\n```bash\n{command}\n```"
            f"{requests}\n\n## Load with transformers{'' if merged else ' + PEFT'}\n\n```python\n{snippet}\n```\n")
