"""The rollout seam: one backend samples for the trainer and for evaluation; the engine equals the reference."""
import logging

import pytest
import torch

from qerl.evaluation.evaluate import evaluate
from qerl.model.aqn import NoiseInjector
from qerl.model.lora import LoraSettings, apply_lora
from qerl.rollout.backends import EngineBackend, ReferenceBackend, Sampling
from qerl.rollout.factory import make_backend
from qerl.rollout.generate import generate
from tests.rollout.test_engine import assert_same, prompts, tiny
from tests.test_trainer import make_trainer, tiny_settings


def test_make_backend_picks_by_kind_and_device():
    model = tiny()
    assert isinstance(make_backend(model, None), ReferenceBackend)  # auto on the CPU: the reference's samples
    engine = make_backend(model, None, "engine", check_every=2)
    assert isinstance(engine, EngineBackend) and engine.engine.check_every == 2
    assert make_backend(model, None, "engine").engine is engine.engine  # one engine per model, shared
    with pytest.raises(ValueError, match="unknown rollout backend 'sglang'; choose one of auto, engine, reference, vllm"):
        make_backend(model, None, "sglang")


def test_an_fp8_kv_cache_the_cpu_cannot_run_is_said_in_the_log(tmp_path, caplog):
    """rollout.kv_cache_dtype: fp8 runs the model's dtype where the engine's fused kernels cannot, "said in the log"
    (qerl/config.py); on the CPU the trainer's sampler (auto: the reference) dropped the setting without a word."""
    with caplog.at_level(logging.INFO, logger="qerl.rollout.engine"):
        trainer = make_trainer(tiny_settings(tmp_path, rollout={"kv_cache_dtype": "fp8"}), tmp_path / "run")
    assert isinstance(trainer.rollout_backend, ReferenceBackend) and not trainer.rollout_backend.engine.kv8
    assert [r.getMessage() for r in caplog.records if r.name == "qerl.rollout.engine"] == [
        "KV cache in the model's dtype, not FP8: the fused decode kernels do not run here"]


def test_both_backends_sample_the_synced_noisy_policy_and_restore_it():
    """sync(): the current LoRA (updated in place) plus AQN noise; the engine matches the reference oracle."""
    model, ps = tiny("qwen2"), prompts()
    params = apply_lora(model, LoraSettings(rank=4, alpha=8))
    reference, engine = ReferenceBackend(model, None), EngineBackend(model, None, check_every=3)
    greedy = Sampling(max_new_tokens=10, temperature=0, eos_token_ids=())
    clean = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(2):
        with torch.no_grad():
            for p in params:  # an optimizer step between rollouts, in place
                p.add_(0.1 * torch.randn_like(p))
        with NoiseInjector(model).noisy(0.05, seed=step):
            expected = generate(model, None, ps, 10, temperature=0, eos_token_ids=[])
        with reference.sync(0.05, noise_seed=step):
            assert_same(reference.generate(ps, greedy), expected)
        with engine.sync(0.05, noise_seed=step):
            assert_same(engine.generate(ps, greedy), expected)
        assert expected.completion_ids != generate(model, None, ps, 10, temperature=0,
                                                   eos_token_ids=[]).completion_ids  # the noise mattered
    for name, p in model.named_parameters():
        if "lora" not in name:
            assert torch.equal(p, clean[name]), name  # noise removed bit for bit
    model.train()
    engine.generate(ps[:1], greedy)
    assert model.training  # the caller's mode is kept


def test_evaluate_samples_through_the_given_backend(tiny_llama_dir):
    from qerl.data import problems as data
    from qerl.model.loading import load_model

    model, tokenizer = load_model(tiny_llama_dir)
    examples = data.load_dataset("arithmetic", split="test", n=5, seed=0, digits=1)
    kw = dict(max_new_tokens=6, batch_size=3, progress=False, reward_fn=lambda text, gold: float(len(text) > 3))
    backend = make_backend(model, tokenizer, "engine")
    steps = backend.engine.stats["steps"]
    by_engine = evaluate(model, tokenizer, examples, backend=backend, **kw)
    assert backend.engine.stats["steps"] > steps
    by_reference = evaluate(model, tokenizer, examples, **kw)  # default on the CPU: the reference
    assert [r["completion"] for r in by_engine.records] == [r["completion"] for r in by_reference.records]
    assert by_engine.metrics["accuracy"] == by_reference.metrics["accuracy"]


def test_trainer_rolls_out_through_its_backend(tmp_path):
    trainer = make_trainer(tiny_settings(tmp_path, rollout={"backend": "engine"}), tmp_path / "run")
    assert isinstance(trainer.rollout_backend, EngineBackend) and trainer.noise is trainer.rollout_backend.noise
    trainer.step = 2  # a noisy stage
    batch = trainer.rollout()
    assert batch.sigma > 0 and trainer.rollout_backend.engine.stats["steps"] > 0
    samples = batch.samples
    assert len(batch) == 8 and all(len(lp) == len(c) for lp, c in zip(samples.logprobs, samples.completion_ids))
    assert isinstance(make_trainer(tiny_settings(tmp_path), tmp_path / "cpu").rollout_backend, ReferenceBackend)


def test_evaluate_with_tools_counts_the_calls_and_the_engine_and_reference_agree(tmp_path):
    """`qerl eval` with rollout.tools: multi-turn completions (tool turns in the graded text), the calls counted in
    the metrics; the bucketed engine and the reference give the same greedy completions."""
    from collections import Counter

    from qerl.data import problems as data
    from qerl.rollout.multi_turn import ToolUse
    from qerl.rollout.tool_calls import ToolCallFormat, ToolTurn
    from tests.test_trainer import char_tokenizer, tiny_model

    tokenizer = char_tokenizer()
    model = tiny_model(tokenizer, seed=3)
    examples = data.load_dataset("arithmetic", split="test", n=6, seed=0, digits=1)
    kw = dict(max_new_tokens=24, batch_size=4, progress=False, reward_fn=lambda text, gold: float("1" in text))
    plain = evaluate(model, tokenizer, examples, **kw)
    common = Counter(c for r in plain.records for c in r["completion"]).most_common(1)[0][0]

    class Any(ToolCallFormat):  # every turn ending at `common` calls `one`
        def parse(self, text):
            return "one", {}

    def one() -> str:
        """One."""
        return "1"

    tools = ToolUse({"one": one}, max_turns=2, format=Any(open="", close=common), turn=ToolTurn("=", "?"))
    by_reference = evaluate(model, tokenizer, examples, tools=tools, **kw)
    by_engine = evaluate(model, tokenizer, examples, tools=tools, backend=make_backend(model, tokenizer, "engine"),
                         **kw)
    assert by_reference.metrics["tool_calls"] > 0 and by_reference.metrics["tool_errors"] == 0
    assert any("=1?" in r["completion"] for r in by_reference.records)
    assert [r["completion"] for r in by_engine.records] == [r["completion"] for r in by_reference.records]
    assert by_engine.metrics["tool_calls"] == by_reference.metrics["tool_calls"]
