"""`rollout.backend: vllm` where vLLM is not installed (CI): the one-line error, and the base folder vLLM would load.

The backend itself runs on a GPU with vLLM: tests/test_gpu_vllm.py.
"""
import importlib.util
import json

import pytest
import torch

from qerl.config import load_settings
from qerl.model.served import served_base, vllm_options
from qerl.rollout.factory import make_backend


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_choosing_vllm_without_it_names_the_extra_in_one_line():
    with pytest.raises(ImportError) as e:
        make_backend(torch.nn.Linear(2, 2), None, "vllm", vllm={})
    assert 'pip install "qerl[vllm]"' in str(e.value) and "\n" not in str(e.value)


def test_params_choose_vllm_and_its_settings():
    s = load_settings(overrides=["rollout.backend=vllm", "rollout.vllm_gpu_memory_utilization=0.4",
                                 "rollout.vllm_lora_update=reload"])
    assert (s.rollout.backend, s.rollout.vllm_gpu_memory_utilization, s.rollout.vllm_lora_update) == \
        ("vllm", 0.4, "reload")
    with pytest.raises(ValueError, match="vllm_lora_update"):
        load_settings(overrides=["rollout.vllm_lora_update=inplace"])


def test_a_bf16_run_serves_its_source_folder(tiny_llama_dir):
    s = load_settings(overrides=[f"model.path={tiny_llama_dir}", "quant.scheme=bf16"])
    assert served_base(s) == tiny_llama_dir


def test_an_nvfp4_run_serves_the_folder_qerl_quantize_writes_once(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))
    s = load_settings(overrides=[f"model.path={tiny_llama_dir}", "quant.scheme=nvfp4", "rollout.prompts_per_step=4",
                                 "rollout.group_size=8", "eval.batch_size=16"])
    folder = served_base(s)
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"
    written = (folder / "config.json").stat().st_mtime_ns
    assert served_base(s) == folder and (folder / "config.json").stat().st_mtime_ns == written  # reused
    options = vllm_options(s, context=512)
    assert options["base"] == folder and options["max_num_seqs"] == 32 and options["max_model_len"] == 512
    # a pre-quantized folder is served as it is
    q = load_settings(overrides=[f"model.path={tiny_llama_dir}", "quant.scheme=nvfp4",
                                 f"quant.quantized_path={folder}"])
    assert served_base(q) == folder
    with pytest.raises(ValueError, match="holds a nvfp4 base but quant.scheme is mxfp4"):
        served_base(load_settings(overrides=[f"model.path={folder}", "quant.scheme=mxfp4"]))


def test_qloras_base_has_no_vllm_form(tiny_llama_dir):
    s = load_settings(overrides=[f"model.path={tiny_llama_dir}", "quant.scheme=nf4-bnb"])
    with pytest.raises(ValueError, match="serves quant.scheme bf16, nvfp4, mxfp4, not 'nf4-bnb'"):
        served_base(s)
