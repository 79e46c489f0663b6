"""The `qerl` command line end to end on CUDA, as a user runs it on a GPU: quantize a Hugging Face folder, train with
the engine and the GEMM dispatch, stop, resume, evaluate and export.

The GPU machines cannot carry the embedded SmolLM2, so the model is a random Llama in SmolLM2-135M's odd shapes
(hidden 576, 9 heads over 3 KV heads: k and v have N = 192, the fused q/k/v N = 960; intermediate 1536) with a
byte-level BPE tokenizer trained here on the arithmetic task's own text. Nothing is downloaded.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.patience import patience

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPO = Path(__file__).resolve().parent.parent
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def qerl(*args, timeout=patience(900), env=None):
    proc = subprocess.run([sys.executable, "-m", "qerl.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout, env=env)
    assert proc.returncode == 0, f"qerl {' '.join(map(str, args))}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("smollm2-shaped"), hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=4, num_attention_heads=9, num_key_value_heads=3)


def write_model(folder: Path, peaked: bool = False, **shape) -> Path:
    """A random bf16 Llama of `shape` with a byte-level BPE tokenizer trained on the arithmetic task, in `folder`;
    `peaked`: weights larger than transformers' init, so greedy decoding meets few near-ties."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from qerl.data.problems import load_dataset  # the task's own prompts and answers train the tokenizer

    corpus = [f"{e.question} {e.gold}" for e in load_dataset("arithmetic", n=400, digits=2, split="train")]
    special = ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=512, special_tokens=special,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|end|>", pad_token="<|end|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)

    config = LlamaConfig(**shape, vocab_size=len(tokenizer), max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if peaked:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else p.shape[-1] ** -0.5 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


def params_file(tmp_path, model_dir, quantized, **overrides):
    p = yaml.safe_load((REPO / "params" / "tiny.yaml").read_text())
    p["model"] = {"path": str(model_dir), "dtype": "auto", "device": "cuda"}
    p["quant"] = {"scheme": "nvfp4", "quantized_path": None if quantized is None else str(quantized)}
    p["train"].update(steps=3, save_every=1, eval_every=0)
    p["rollout"].update(prompts_per_step=4, group_size=4)
    p["eval"].update(n=8, batch_size=8, out_dir=str(tmp_path / "eval"))
    p["tracking"] = {"backend": "none"}
    for key, value in overrides.items():
        section, name = key.split("__")
        p[section][name] = value
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(p))
    return path


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("scheme,layout", [("nvfp4", "humming"), ("nvfp4", "gluon"), ("bf16", "auto"),
                                           ("nf4-bnb", "auto")])
def test_gpu_quantize_train_resume_eval_export(model_dir, tmp_path, scheme, layout):
    from safetensors.torch import load_file

    if scheme == "nf4-bnb":
        pytest.importorskip("bitsandbytes")
    quantized = None
    if scheme == "nvfp4":
        quantized = tmp_path / "nvfp4"
        qerl("quantize", "--model", model_dir, "--out", quantized, "--scheme", "nvfp4")
    params = params_file(tmp_path, model_dir, quantized, quant__scheme=scheme, quant__gpu_layout=layout)

    whole, part = tmp_path / "whole", tmp_path / "part"
    qerl("train", "--params", params, "--out", whole)
    qerl("train", "--params", params, "--out", part, "--max-steps", 2)  # stopped after step 2
    assert [m["step"] for m in metrics(part)] == [1, 2]
    qerl("train", "--params", params, "--out", part, "--resume")

    a, b = metrics(whole), metrics(part)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3]
    for x, y in zip(a, b):  # the same rollouts: the resumed run continues the same random streams
        assert x["response_length"] == y["response_length"], (x, y)
        assert abs(x["entropy"] - y["entropy"]) <= 1e-3, (x, y)
    wa, wb = (load_file(run / "adapter" / "adapter_model.safetensors") for run in (whole, part))
    assert wa.keys() == wb.keys()
    worst = max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)
    assert worst <= 1e-3, f"resumed adapter differs from the uninterrupted one by {worst}"

    qerl("eval", "--params", params, "--adapter", whole / "adapter")
    result = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert result["num_examples"] == 8 and 0.0 <= result["accuracy"] <= 1.0

    for merge in ([], ["--merge"]):
        out = tmp_path / f"export{'-merged' if merge else ''}"
        qerl("export", "--adapter", whole / "adapter", "--out", out, *merge)
        assert "vllm serve" in (out / "README.md").read_text()


def test_gpu_train_on_a_fresh_machine_compiles_in_workers(model_dir, tmp_path):
    """On an empty Triton cache `qerl train` compiles its kernels in worker processes while the base loads
    (model.precompile_kernels): the trainer itself then compiles at most a few, and the next run skips the workers."""
    cache = tmp_path / "triton"
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), QERL_GEMM_CACHE=str(tmp_path / "gemm.json"))
    params = params_file(tmp_path, model_dir, None, quant__gpu_layout="gluon", model__precompile_kernels=True)
    first = qerl("train", "--params", params, "--out", tmp_path / "a", "--max-steps", 1, env=env)
    # What the workers did (a failed one says why in the trainer's warning), then the end of the run's log
    # (with TORCH_LOGS=recompiles in the environment, also what made Dynamo compile again in the trainer)
    said = [line for line in first.stderr.splitlines()
            if "precompil" in line or "ecompiling" in line or "guard failure" in line or line.startswith("    - ")]
    log = "\n".join(said[:20]) + "\n...\n" + first.stderr[-3000:]
    stamps = list((cache / "qerl-precompiled").glob("*"))
    assert len(stamps) == 1, log
    cubins = [p for p in cache.rglob("*.cubin")]
    by_trainer = sorted(p.name for p in cubins if p.stat().st_mtime > stamps[0].stat().st_mtime)
    # The workers compile from the first step's prompt length and full-length completions: a batch whose longest
    # completion ends early gives a few kernels other token counts, which the trainer compiles itself.
    assert len(cubins) >= 10 and len(by_trainer) <= 3, f"{len(cubins)} kernels, the trainer's: {by_trainer}\n{log}"
    second = qerl("train", "--params", params, "--out", tmp_path / "b", "--max-steps", 1, env=env)
    assert "are in the Triton cache" in second.stderr + second.stdout, second.stderr[-4000:]
