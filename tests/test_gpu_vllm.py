"""vLLM beside qerl on CUDA (issue 46): our export served by vLLM gives our engine's greedy tokens, and
`rollout.backend: vllm` trains, resumes and evaluates through `qerl train` / `qerl eval`.

Needs CUDA and vLLM (`pip install "qerl[vllm]"`; on the GPU machines `benchmarks/stage_vllm.sh` stages it). The model
is a random Llama whose every projection fits vLLM's Marlin FP4 kernels (in_features a multiple of 128, out_features
of 64), with test_gpu_cli's byte-level tokenizer trained on the arithmetic task. Nothing is downloaded.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.patience import patience
from tests.test_gpu_cli import REPO, metrics, params_file, write_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (qerl[vllm])")]

SHAPE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2)
# A vLLM greedy token must be our own forward's argmax, or as good to within this many nats under our forward:
# two engines' bf16 roundings may order near-ties differently, nothing more.
NEAR_TIE = 0.05


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("marlin-shaped"), peaked=True, **SHAPE)


@pytest.fixture(scope="module")
def vllm_env():
    return dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_NO_USAGE_STATS="1")


def qerl(*args, env=None):
    proc = subprocess.run([sys.executable, "-m", "qerl.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=patience(900), env=env)
    assert proc.returncode == 0, f"qerl {' '.join(map(str, args))}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def served_tokens(folder: Path, prompts: list[list[int]], adapter: Path | None, out: Path, env) -> list[list[int]]:
    """vLLM's greedy 32 tokens of each prompt, in a process of its own (as a user's `vllm serve`)."""
    script = f"""
import json
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
llm = LLM(model={str(folder)!r}, dtype="bfloat16", enable_lora={adapter is not None}, max_lora_rank=16,
          max_model_len=1024, gpu_memory_utilization=0.3, seed=0)
lora = LoRARequest("policy", 1, {str(adapter)!r}) if {adapter is not None} else None
outs = llm.generate([{{"prompt_token_ids": p}} for p in {prompts!r}],
                    SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), lora_request=lora, use_tqdm=False)
open({str(out)!r}, "w").write(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=patience(600),
                          env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def greedy_gaps(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """Per position, how far (nats, under our forward) `tokens` falls behind our argmax: 0 where they agree."""
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        logits = model(ids)
        logp = torch.log_softmax(getattr(logits, "logits", logits)[0, len(prompt) - 1:-1].float(), -1)
    return (logp.max(-1).values - logp.gather(-1, ids[0, len(prompt):, None])[:, 0]).tolist()


@pytest.mark.parametrize("merge", [False, True], ids=["adapter", "merged"])
def test_our_export_served_by_vllm_gives_our_greedy_tokens(tmp_path, model_dir, vllm_env, merge):
    from qerl.config import load_settings
    from qerl.model import lora
    from qerl.model.export import export_policy
    from qerl.model.runtime import load_base_model
    from qerl.quant.checkpoint import quantize_checkpoint
    from qerl.rollout.backends import Sampling
    from qerl.rollout.factory import make_backend

    quantize_checkpoint(model_dir, tmp_path / "nvfp4", "nvfp4", progress=False)
    s = load_settings(overrides=[f"model.path={tmp_path / 'nvfp4'}", "model.device=cuda", "quant.scheme=nvfp4",
                                 "lora.rank=16", "lora.alpha=32"])
    model, tokenizer = load_base_model(s.model, s.quant)
    torch.manual_seed(0)
    for p in lora.apply_lora(model, s.lora, dtype=torch.bfloat16):
        if p.dim() == 2 and p.shape[1] == s.lora.rank:
            p.data.normal_(0, 0.02)  # lora_B: a policy that differs from its base
    lora.save_adapter(model, tmp_path / "adapter", str(tmp_path / "nvfp4"), s.lora)
    export = export_policy(tmp_path / "adapter", tmp_path / "export", merge=merge)
    if merge:  # the merged export is its own (re-quantized) model: ours is that folder, loaded by qerl
        s = load_settings(overrides=[f"model.path={export.out}", "model.device=cuda", "quant.scheme=nvfp4"])
        model, tokenizer = load_base_model(s.model, s.quant)
    prompts = [tokenizer.encode(f"<|user|>What is {a} + {b}?<|end|><|assistant|>") for a, b in
               [(3, 4), (12, 30), (7, 7), (25, 61), (90, 9), (40, 2)]]
    ours = make_backend(model, tokenizer, "engine").generate(prompts, Sampling(max_new_tokens=32, temperature=0,
                                                                               eos_token_ids=()))
    theirs = served_tokens(export.out if merge else export.out / "base", prompts,
                           None if merge else export.out / "adapter", tmp_path / "served.json", vllm_env)
    same = sum(a == b for a, b in zip(ours.completion_ids, theirs))
    worst = max(max(greedy_gaps(model, p, t)) for p, t in zip(prompts, theirs))
    print(f"vLLM's greedy tokens equal ours in {same} of {len(prompts)} prompts; worst gap {worst:.4f} nats")
    assert worst <= NEAR_TIE, f"vLLM chose a token {worst:.3f} nats below our argmax ({same}/{len(prompts)} equal)"
    assert same >= len(prompts) // 2


def test_vllm_backend_trains_resumes_and_evaluates(tmp_path, model_dir, vllm_env):
    params = params_file(tmp_path, model_dir, None, rollout__backend="vllm")
    p = yaml.safe_load(params.read_text())
    p["train"].update(steps=2)
    params.write_text(yaml.safe_dump(p))
    run = tmp_path / "run"
    out = qerl("train", "--params", params, "--out", run, env=vllm_env)
    assert "grpo.correction auto: tis" in out.stdout + out.stderr  # vLLM's numerics are not the update's
    p["train"].update(steps=3)
    params.write_text(yaml.safe_dump(p))
    qerl("train", "--params", params, "--out", run, "--resume", env=vllm_env)
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    gaps = [r["rollout_logp_gap/mean"] for r in rows]
    print("vLLM rollout / trainer log-prob gap per step:", gaps)
    assert all(0 <= g < 0.5 for g in gaps)
    qerl("eval", "--params", params, "--adapter", run / "adapter", env=vllm_env)
    result = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert result["num_examples"] == 8 and 0.0 <= result["accuracy"] <= 1.0
