"""`qerl export` on the embedded SmolLM2: the unmerged (NVFP4 base + PEFT adapter) and merged folders load in
transformers (compressed-tensors decompression) and PEFT through the README's own snippet and give qerl's greedy
tokens; the vLLM command names what was written; a mismatched adapter fails in one line."""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from qerl.cli import main
from qerl.model import lora

pytest.importorskip("peft")
pytest.importorskip("compressed_tensors")

NEW_TOKENS = 16
QUESTION = "What is 17 + 25?"


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """qerl's policy as trained: the embedded model, NVFP4 in memory, a LoRA adapter with nonzero B (saved)."""
    from qerl.model.loading import load_model
    from qerl.quant.linear import quantize_model

    model, tokenizer = load_model("embedded")
    quantize_model(model, "nvfp4")
    settings = lora.LoraSettings(rank=8, alpha=16)
    torch.manual_seed(0)  # lora_A's initialization draws from the global generator: whatever ran before, the same A
    lora.apply_lora(model, settings)
    g = torch.Generator().manual_seed(0)
    # Small enough that the model still answers, large enough to change its answer ("= 31" where the base says
    # "= 39") at 1 and 2 threads; at 0.04 with an unseeded A the change depended on what the process had drawn.
    with torch.no_grad():
        for layer in lora.lora_layers(model).values():
            layer.lora_B.copy_(0.08 * torch.randn(layer.lora_B.shape, generator=g))
    adapter = lora.save_adapter(model, tmp_path_factory.mktemp("run") / "adapter", "embedded", settings)
    return model, tokenizer, adapter


def prompt_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def qerl_greedy(model, tokenizer) -> list[int]:
    from qerl.rollout.generate import generate

    return generate(model, tokenizer, [prompt_ids(tokenizer)], max_new_tokens=NEW_TOKENS,
                    temperature=0.0).completion_ids[0]


def snippet_model(out):
    """Run the README's python snippet as a user would paste it, in the export's folder as it says; return its model
    and tokenizer."""
    readme = (out / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    namespace: dict = {}
    with contextlib.chdir(out):
        exec(compile(code, str(out / "README.md"), "exec"), namespace)  # noqa: S102 - our own generated snippet
    return namespace["model"], namespace["tokenizer"]


def transformers_greedy(model, tokenizer) -> list[int]:
    ids = torch.tensor([prompt_ids(tokenizer)])
    with torch.no_grad():  # fp32 compute, as qerl's on the CPU: the weights are what is compared
        out = model.float().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                     do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def vllm_command(out) -> list[str]:
    block = re.search(r"```bash\n(.*?)\n```", (out / "README.md").read_text(), re.S).group(1)
    return shlex.split(block)


@pytest.mark.slow
def test_unmerged_export_is_the_policy_in_transformers_and_peft(policy, tmp_path, capsys):
    model, tokenizer, adapter = policy
    out = tmp_path / "export"
    killed = tmp_path / ".export.tmp-killed"  # what an export killed half-way leaves beside its destination
    (killed / "export" / "base").mkdir(parents=True)
    (killed / "export" / "base" / "model.safetensors").write_bytes(b"\0" * 1000)
    assert main(["export", "--adapter", str(adapter), "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"cd {out} && " + " ".join(vllm_command(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # the killed one's remains and the lock are gone

    # vLLM: the base folder in compressed-tensors NVFP4, the adapter registered by name, rank within the limit.
    command = vllm_command(out)
    assert command[:3] == ["vllm", "serve", "./base"] and "--enable-lora" in command  # run from the export's folder
    name, _, path = command[command.index("--lora-modules") + 1].partition("=")
    assert name == "export" and path == "./adapter"
    assert int(command[command.index("--max-lora-rank") + 1]) >= 8
    config = json.loads((out / "base" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "nvfp4-pack-quantized"
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["r"] == 8

    hf_model, hf_tokenizer = snippet_model(out)
    assert type(hf_model).__name__ == "PeftModelForCausalLM"
    expected = qerl_greedy(model, tokenizer)
    assert transformers_greedy(hf_model, hf_tokenizer) == expected
    with lora.adapters_disabled(model):  # the adapter matters: an export that dropped it would fail above
        assert qerl_greedy(model, tokenizer) != expected


@pytest.mark.slow
def test_merged_export_loads_in_transformers_with_qerls_greedy_tokens(policy, tmp_path):
    from qerl.model.loading import load_model

    _, _, adapter = policy
    out = tmp_path / "merged"
    assert main(["export", "--adapter", str(adapter), "--out", str(out), "--merge"]) == 0
    assert vllm_command(out) == ["vllm", "serve", ".", "--served-model-name", "merged"]
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == "nvfp4-pack-quantized" and not (out / "adapter_config.json").exists()

    hf_model, hf_tokenizer = snippet_model(out)
    ours, tokenizer = load_model(out, dtype=torch.float32)
    assert transformers_greedy(hf_model, hf_tokenizer) == qerl_greedy(ours, tokenizer)


def test_mismatched_adapter_and_bad_destinations_fail_in_one_line(tiny_llama_dir, tmp_path, capsys):
    from qerl.model.loading import load_model

    model, _ = load_model(tiny_llama_dir)  # hidden size 64: its adapter cannot fit SmolLM2's 576
    settings = lora.LoraSettings(rank=4, alpha=8, target_modules=("q_proj",))
    lora.apply_lora(model, settings)
    adapter = lora.save_adapter(model, tmp_path / "adapter", "embedded", settings)

    def error(*args: str) -> str:
        assert main(["export", "--adapter", str(adapter), *args]) == 2  # bad input
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1
        return lines[0]

    message = error("--out", str(tmp_path / "out"))
    assert message.startswith("qerl: error: the adapter does not match the base ")
    assert "shape mismatch" in message and "model.layers.0.self_attn.q_proj.lora_A.weight: file (4, 64) vs " \
                                              "model (4, 576)" in message
    assert not (tmp_path / "out").exists()

    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "/gone/base"}))
    assert "the adapter's base '/gone/base' (adapter_config.json base_model_name_or_path) does not exist here: " \
           "pass --model" in error("--out", str(tmp_path / "out"))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    assert "--out" in error("--out", str(tmp_path / "taken"), "--model", str(tiny_llama_dir))


@pytest.mark.parametrize("merge", [False, True], ids=["unmerged", "merged"])
def test_an_export_moved_elsewhere_holds_no_path_of_the_machine_it_came_from(tiny_llama_dir, tmp_path, capsys, merge):
    """Its README's commands and the adapter's base named absolute paths where it was written: copied to a server,
    they named folders that are not there. Now they are relative to the export's folder, and run from it."""
    from qerl.model.loading import load_model

    made = tmp_path / "made-here"
    model, _ = load_model(tiny_llama_dir)
    settings = lora.LoraSettings(rank=4, alpha=8, target_modules=("q_proj", "v_proj"))
    lora.apply_lora(model, settings)
    adapter = lora.save_adapter(model, made / "adapter", str(tiny_llama_dir), settings)
    assert main(["export", "--adapter", str(adapter), "--out", str(made / "export")] + ["--merge"] * merge) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"cd {made / 'export'} && " + " ".join(
        vllm_command(made / "export"))
    moved = tmp_path / "elsewhere" / "served"
    moved.parent.mkdir()
    shutil.move(made / "export", moved)
    machine = [str(tmp_path), str(tiny_llama_dir), str(Path.cwd())]  # where it was made, its base, the shell's cwd
    for file in moved.rglob("*"):
        if file.suffix in (".md", ".json", ".jinja", ".txt"):
            text = file.read_text()
            assert not [m for m in machine if m in text], f"{file.relative_to(moved)} names a path of this machine"
    command = vllm_command(moved)
    folders = [command[2]] + ([] if merge else [command[command.index("--lora-modules") + 1].partition("=")[2]])
    assert all((moved / f).is_dir() for f in folders), command
    hf_model, _ = snippet_model(moved)  # run from the export's folder, as it says
    assert type(hf_model).__name__ == ("LlamaForCausalLM" if merge else "PeftModelForCausalLM")


@pytest.mark.parametrize("merge", [False, True], ids=["unmerged", "merged"])
def test_an_fp8_policy_exports_its_base_as_compressed_tensors_fp8(tiny_llama_dir, tmp_path, capsys, merge):
    """quant.scheme fp8: the unmerged base holds the codes the run quantized in memory; the merged one is the
    dequantized base plus the LoRA update, rounded to FP8 again. Both read back in qerl and in transformers."""
    from qerl.model.loading import load_model
    from qerl.quant.linear import QuantLinear, quantize_model

    model, _ = load_model(tiny_llama_dir)
    quantize_model(model, "fp8")
    settings = lora.LoraSettings(rank=4, alpha=8, target_modules=("q_proj", "v_proj"))
    torch.manual_seed(0)
    lora.apply_lora(model, settings)
    with torch.no_grad():
        for layer in lora.lora_layers(model).values():
            layer.lora_B.copy_(0.05 * torch.randn(layer.lora_B.shape))
    adapter = lora.save_adapter(model, tmp_path / "adapter", str(tiny_llama_dir), settings)
    out = tmp_path / "export"
    assert main(["export", "--adapter", str(adapter), "--out", str(out), "--scheme", "fp8"] + ["--merge"] * merge) == 0
    capsys.readouterr()
    base = out if merge else out / "base"
    config = json.loads((base / "config.json").read_text())["quantization_config"]
    assert config["format"] == "float-quantized"
    exported, _ = load_model(base, dtype=torch.float32)
    q_proj = exported.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(q_proj, QuantLinear) and q_proj.scheme == "fp8"
    trained = lora.lora_layers(model)["model.layers.0.self_attn.q_proj"]
    base_w = trained.base.dequantized_weight(torch.float32)
    if merge:  # base + scaling * B A, re-quantized: within FP8's rounding of the merged weight
        merged = base_w + trained.scaling * trained.lora_B.detach() @ trained.lora_A.detach()
        got = q_proj.dequantized_weight(torch.float32)
        assert ((got - merged).norm() / merged.norm()).item() < 0.035
        assert not torch.allclose(got, base_w, atol=1e-3)  # the update is in it
    else:  # the very codes trained on
        for name, tensor in trained.base.quantized_tensors().items():
            assert torch.equal(q_proj.quantized_tensors()[name].view(torch.uint8), tensor.view(torch.uint8)), name
    hf_model, _ = snippet_model(out)  # transformers + compressed-tensors read it, as the README says
    assert type(hf_model).__name__ == ("LlamaForCausalLM" if merge else "PeftModelForCausalLM")
