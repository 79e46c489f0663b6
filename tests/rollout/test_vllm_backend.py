"""`rollout.backend: vllm` where vLLM is not installed (CI): the one-line error, and the base folder vLLM would load.

The backend itself runs on a GPU with vLLM: tests/test_gpu_vllm.py.
"""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from qerl.config import load_settings
from qerl.model.served import served_base, vllm_options
from qerl.rollout.factory import make_backend


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_choosing_vllm_without_it_names_the_extra_in_one_line():
    with pytest.raises(ImportError) as e:
        make_backend(torch.nn.Linear(2, 2), None, "vllm", vllm=dict)
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


def test_an_fp8_run_serves_compressed_tensors_fp8_dynamic(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))
    folder = served_base(load_settings(overrides=[f"model.path={tiny_llama_dir}", "quant.scheme=fp8"]))
    group = json.loads((folder / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert (group["format"], group["weights"]["strategy"], group["input_activations"]["strategy"]) == \
        ("float-quantized", "channel", "token")  # vLLM's W8A8 FP8 with per-token dynamic activations


@pytest.mark.parametrize("kv_cache_dtype, vllms", [("model", "auto"), ("fp8", "fp8")])
def test_the_kv_cache_dtype_reaches_vllms_engine(tiny_llama_dir, kv_cache_dtype, vllms):
    """rollout.kv_cache_dtype: fp8 under backend vllm was silently ignored: the engine cached in the model's dtype."""
    from qerl.rollout.vllm_backend import VLLMOptions, engine_arguments

    s = load_settings(overrides=[f"model.path={tiny_llama_dir}", "quant.scheme=bf16", "rollout.backend=vllm",
                                 f"rollout.kv_cache_dtype={kv_cache_dtype}"])
    arguments = engine_arguments(VLLMOptions(**vllm_options(s, context=512)), detokenize=True)
    assert arguments["kv_cache_dtype"] == vllms
    assert (arguments["model"], arguments["max_model_len"], arguments["dtype"], arguments["enable_sleep_mode"]) == \
        (str(tiny_llama_dir), 512, "bfloat16", True)


def test_qloras_base_has_no_vllm_form(tiny_llama_dir):
    s = load_settings(overrides=[f"model.path={tiny_llama_dir}", "quant.scheme=nf4-bnb"])
    with pytest.raises(ValueError, match="serves quant.scheme nvfp4, mxfp4, fp8, bf16, not 'nf4-bnb'"):
        served_base(s)


class _Engine:
    """vLLM's LLMEngine as the backend drives its LoRA: what it was asked, in order."""

    def __init__(self):
        self.calls = []

    def add_lora(self, request):
        self.calls.append(("add", request.lora_int_id, request.load_inplace))

    def remove_lora(self, lora_id):
        self.calls.append(("remove", lora_id))


@pytest.mark.parametrize("update", ["new_id", "reload"])
def test_the_policy_reaches_vllm_once_per_change_and_no_request_reloads_it(tiny_llama_dir, tmp_path, monkeypatch,
                                                                           update):
    """generate's LoRARequest goes with every engine step: one with load_inplace made vLLM 0.26 reload the adapter
    from its files at each of a 7B rollout's 1,024 steps (65 s instead of 9). `reload` loads it once per change."""
    import dataclasses
    import sys
    import types

    from safetensors.torch import load_file

    from qerl.config import LoraSettings
    from qerl.model import lora
    from qerl.model.loading import load_model
    from qerl.rollout.vllm_backend import VLLMBackend, VLLMOptions

    @dataclasses.dataclass
    class LoRARequest:  # vllm.lora.request.LoRARequest's fields that the backend uses
        lora_name: str
        lora_int_id: int
        lora_path: str
        load_inplace: bool = False

    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.lora", types.ModuleType("vllm.lora"))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", types.SimpleNamespace(LoRARequest=LoRARequest))
    model, _ = load_model(str(tiny_llama_dir), device="cpu")
    settings = LoraSettings(rank=4, alpha=8)
    params = lora.apply_lora(model, settings)
    backend = object.__new__(VLLMBackend)  # everything but vLLM's engine, which is the stand-in
    backend.model, backend.llm = model, types.SimpleNamespace(llm_engine=_Engine())
    backend.options = VLLMOptions(base=tiny_llama_dir, lora=settings, max_model_len=64, lora_update=update)
    backend._adapter_dir, backend._lora_id, backend._lora_version = tmp_path, 0, None

    requests = [backend._lora_request() for _ in range(2)]  # two rollouts, the policy unchanged
    with torch.no_grad():
        params[1].add_(1.0)  # an update
    requests += [backend._lora_request() for _ in range(2)]
    assert not any(r.load_inplace for r in requests)
    ids = [r.lora_int_id for r in requests]
    if update == "new_id":
        assert ids == [1, 1, 2, 2] and backend.llm.llm_engine.calls == [("remove", 1)]
    else:
        assert ids == [1, 1, 1, 1] and backend.llm.llm_engine.calls == [("add", 1, True)]
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")  # what vLLM reads: the updated policy
    assert any(t.shape == params[1].shape and torch.equal(t, params[1].detach().to(t.dtype)) for t in saved.values())


def test_a_sleeping_vllm_is_not_counted_in_the_steps_peak(monkeypatch):
    """vLLM's sleep unmaps its pool under live tensors that torch.cuda.max_memory_allocated still counts: the 7B
    step's update reported 106.5 GiB, 66 of them the trainer's. The backend declares what the device got back while
    it sleeps, and the step's peak leaves it out; awake, vLLM's pool is counted as it is."""
    import types

    from qerl.rl.memory import peak_memory_gb
    from qerl.rollout import releasable
    from qerl.rollout.vllm_backend import VLLMBackend, VLLMOptions

    GiB = 2**30
    free = {"bytes": 20 * GiB}

    class LLM:  # vLLM's sleep gives its 41 GiB pool back to the driver; waking takes it again
        def sleep(self, level):
            free["bytes"] += 41 * GiB

        def wake_up(self):
            free["bytes"] -= 41 * GiB

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 141 * GiB))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 107 * GiB)  # the trainer's 66 + 41
    backend = object.__new__(VLLMBackend)
    backend.llm, backend._asleep, backend._adapter_dir = LLM(), False, Path("/nonexistent")
    backend.options = VLLMOptions(base=Path("."), lora=None, max_model_len=64)
    cuda = torch.device("cuda", 0)
    try:
        assert peak_memory_gb(cuda) == 107  # awake: all of it is real
        backend.sleep()
        assert releasable.released_bytes(0) == 41 * GiB and peak_memory_gb(cuda) == 66
        backend.wake()
        assert peak_memory_gb(cuda) == 107
        backend.sleep()
        backend.close()  # the engine may go: count it again rather than too little
        assert releasable.released_bytes(0) == 0
    finally:
        releasable.set_released_bytes(0, 0)


def test_vllm_wakes_after_the_updates_cache_went_back_to_the_driver(monkeypatch):
    """The 7B step's device peak beside vLLM was 104 GiB against the trainer's 60: the update left its blocks in
    PyTorch's cache and vLLM took its 41 GiB pool next to them. What the device holds once vLLM is awake is the
    trainer's live tensors and vLLM's pool, not the update's cache."""
    from qerl.rollout.vllm_backend import VLLMBackend, VLLMOptions

    GiB = 2**30
    device = {"live": 25 * GiB, "cached": 35 * GiB, "peak": 0}

    def empty_cache():
        device["cached"] = 0

    class LLM:
        def wake_up(self):
            device["peak"] = max(device["peak"], device["live"] + device["cached"] + 41 * GiB)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    backend = object.__new__(VLLMBackend)
    backend.llm, backend._asleep = LLM(), True
    backend.options = VLLMOptions(base=Path("."), lora=None, max_model_len=64)
    backend.wake()
    assert device["peak"] == 66 * GiB and not backend._asleep


def test_beside_vllm_our_model_keeps_no_fp8_copies_unless_the_update_reads_them():
    """quant.fp8_weights auto: the FP8 copies serve our engine's many-row forwards and the FP8 update; where vLLM
    samples and the update is bf16 they would only hold a byte per weight (6.1 GiB at 7B) beside vLLM's base."""
    from qerl.model.served import own_model_settings

    def fp8(*overrides):
        return own_model_settings(load_settings(overrides=list(overrides))).quant.fp8_weights

    assert fp8("rollout.backend=vllm") is False
    assert fp8("rollout.backend=vllm", "model.base_gemm=fp8") == "auto"  # the FP8 update reads them
    assert fp8("rollout.backend=vllm", "quant.fp8_weights=true") is True  # asked for
    assert fp8() == "auto"  # our engine samples: the copies are its many-row GEMMs
