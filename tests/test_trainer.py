"""The RL loop on a tiny model: it learns, it is deterministic, and a killed run resumes to the same adapter."""

import contextlib
import dataclasses
import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file

from qerl.config import settings_from_dict
from qerl.model.transformer import ModelConfig, Transformer
from qerl.rl.optim import lr_lambda
from qerl.rl.trainer import Trainer

CHARS = list("0123456789+-*= ?Wthaisx\\{}")


def char_tokenizer():
    """A character-level tokenizer with a chat template, so the loop runs end to end with no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(["<pad>", "<eos>", "<unk>"] + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()  # characters join without spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}="
    return fast


def tiny_model(tokenizer, seed=0):
    torch.manual_seed(seed)
    config = ModelConfig.from_hf({
        "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": len(tokenizer), "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256, "tie_word_embeddings": False, "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
    })
    model = Transformer.from_config(config, dtype=torch.float32)
    # Small weights (as HF initializes) keep sampling near-uniform at the start; a larger untied lm_head leaves
    # room to learn (a normalized hidden state times 0.02-scale rows cannot move a logit by more than ~0.6).
    for name, p in model.named_parameters():
        if "norm" not in name:
            torch.nn.init.normal_(p, std=0.15 if name.startswith("lm_head") else 0.02)
    return model


def ones_reward(completion: str, gold: str) -> float:
    """A learnable toy reward: the share of '1' characters in the completion."""
    return completion.count("1") / max(len(completion), 1)


def even_gold_reward(completion: str, gold: str) -> float:
    """Equal within every group: no group carries a learning signal."""
    return float(int(gold) % 2 == 0)


def odd_gold_ones_reward(completion: str, gold: str) -> float:
    """ones_reward for odd answers, 0 for even ones: some groups carry a signal, the others none."""
    return ones_reward(completion, gold) if int(gold) % 2 else 0.0


def tiny_settings(tmp_path, **sections):
    raw = {
        "quant": {"scheme": "nvfp4"},
        "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6, "temperature": 1.0},
        "grpo": {"loss_type": "dapo", "micro_batch_size": 3},
        "aqn": {"enabled": True, "sigma_start": 0.05, "sigma_end": 0.01, "num_stages": 3},
        "optim": {"lr": 3e-2, "warmup_steps": 0, "schedule": "constant"},
        "train": {"steps": 4, "save_every": 2, "seed": 7, "rewards": {"tests.test_trainer:ones_reward": 1.0}},
        "data": {"name": "arithmetic", "n": 40, "digits": 1},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return settings_from_dict(raw)


def make_trainer(settings, out, resume=False, **options):
    tok = char_tokenizer()
    model = tiny_model(tok)
    from qerl.quant.linear import quantize_model

    quantize_model(model, settings.quant.scheme)
    model.requires_grad_(False)
    return Trainer(settings, out, resume=resume, model=model, tokenizer=tok, progress=False, **options)


def adapter_tensors(run_dir):
    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    assert lr_lambda(0, 4, 100, "cosine", 0.1) == pytest.approx(0.25)
    assert lr_lambda(3, 4, 100, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_lambda(4, 4, 100, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_lambda(52, 4, 100, "cosine", 0.1) == pytest.approx(0.55)
    assert lr_lambda(100, 4, 100, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_lambda(50, 0, 100, "constant", 0.1) == 1.0


def test_one_run_writes_metrics_checkpoints_adapter_and_plots(tmp_path):
    trainer = make_trainer(tiny_settings(tmp_path, grpo={"beta": 0.04}), tmp_path / "run")
    adapter = trainer.train()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    required = {"reward_mean", "reward_std", "accuracy", "entropy", "kl", "clip_ratio/region", "response_length",
                "truncation_rate", "sigma", "noise_seed", "rollout_tokens_per_s", "seconds_rollout",
                "seconds_scoring", "seconds_update", "peak_memory_gb", "lr", "grad_norm", "grader_timeouts"}
    assert required <= set(lines[0])
    # AQN: the first stage is noise-free, later stages are not
    assert lines[0]["sigma"] == 0.0 and lines[-1]["sigma"] > 0
    assert (adapter / "adapter_config.json").is_file()
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert ckpts == ["step-000002", "step-000004"]
    assert (tmp_path / "run" / "reward_curve.png").stat().st_size > 1000
    assert (tmp_path / "run" / "params.yaml").is_file()


def test_rollout_noise_is_removed_exactly_after_every_step(tmp_path):
    trainer = make_trainer(tiny_settings(tmp_path, aqn={"sigma_start": 0.5, "sigma_end": 0.1}), tmp_path / "run")
    trainer.step = 2  # a noisy stage
    norms = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "norm" in n}
    batch = trainer.rollout()
    assert batch.sigma > 0
    for name, p in trainer.model.named_parameters():
        if name in norms:
            assert torch.equal(p, norms[name]), name


def test_same_seed_same_run(tmp_path):
    a = make_trainer(tiny_settings(tmp_path), tmp_path / "a")
    a.train()
    b = make_trainer(tiny_settings(tmp_path), tmp_path / "b")
    b.train()
    ta, tb = adapter_tensors(tmp_path / "a"), adapter_tensors(tmp_path / "b")
    assert ta.keys() == tb.keys()
    assert all(torch.equal(ta[k], tb[k]) for k in ta)


def runs_with_and_without(settings, tmp_path, switch: str) -> list[tuple[list[dict], dict]]:
    """(metrics rows, adapter tensors) of a run with the update forward's `switch` (a field of its
    `PolicyLogProbs`) on (the CPU's default, asserted), then of the same run with it off."""
    runs = []
    for on in (True, False):
        trainer = make_trainer(settings, tmp_path / str(on))
        update = trainer.policy_update
        assert getattr(update.logprobs, switch)
        update.logprobs = dataclasses.replace(update.logprobs, **{switch: on})
        trainer.train()
        runs.append(([json.loads(x) for x in (tmp_path / str(on) / "metrics.jsonl").read_text().splitlines()],
                     adapter_tensors(tmp_path / str(on))))
    return runs


def test_shared_prompts_update_is_the_plain_update(tmp_path):
    """On the CPU the update runs each group's prompt once (micro-batches of 3 cut across the groups of 4 here):
    the same losses, entropies, gradient norms and adapter as running every row's prompt, to fp32 rounding."""
    (shared_rows, shared_adapter), (plain_rows, plain_adapter) = runs_with_and_without(
        tiny_settings(tmp_path, train={"steps": 2}), tmp_path, "share_prompts")
    for a, b in zip(shared_rows, plain_rows):
        assert a["reward_mean"] == b["reward_mean"]
        for key in ("loss", "entropy", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    assert all(torch.allclose(shared_adapter[k], plain_adapter[k], atol=1e-5) for k in plain_adapter)


def test_packed_update_is_the_padded_update(tmp_path):
    """model.pack_completions: only the real tokens through the GEMMs and the head (completions of different lengths
    here, shorter than max_new_tokens), with shared prompts or not: the padded update's metrics and adapter."""
    runs = []
    for name, model in [("padded", {}), ("packed", {"pack_completions": True}),
                        ("packed-unshared", {"pack_completions": True, "share_prompts": False})]:
        # One step: a second one's AdamW, at this lr, moves elements whose gradient is a rounding residue (~1e-8)
        settings = tiny_settings(tmp_path, train={"steps": 1}, model=model,
                                 rollout={"stop_strings": ["+", "-", "="]})  # completions that end early
        make_trainer(settings, tmp_path / name).train()
        runs.append(([json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()],
                     adapter_tensors(tmp_path / name)))
    (padded_rows, padded_adapter), *packed_runs = runs
    assert min(r["response_length"] for r in padded_rows) < 6  # some completions ended early: padding to skip
    for packed_rows, packed_adapter in packed_runs:
        for a, b in zip(packed_rows, padded_rows):
            assert a["reward_mean"] == b["reward_mean"]
            for key in ("loss", "entropy", "grad_norm", "clip_ratio/region", "rollout_logp_gap/mean"):
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        assert all(torch.allclose(packed_adapter[k], padded_adapter[k], atol=1e-5) for k in padded_adapter)


@pytest.mark.parametrize("reward", ["odd_gold_ones_reward", "even_gold_reward"])
def test_idle_rows_without_autograd_give_the_plain_update(tmp_path, reward):
    """On the CPU rows of zero advantage run their forward without autograd (and a micro-batch of only such rows no
    backward: its zero gradient still steps AdamW's moments): the same metrics and adapter as the plain update."""
    settings = tiny_settings(tmp_path, train={"steps": 3, "rewards": {f"tests.test_trainer:{reward}": 1.0}},
                             optim={"weight_decay": 0.1})
    (skip_rows, skip_adapter), (plain_rows, plain_adapter) = runs_with_and_without(settings, tmp_path,
                                                                                   "skip_idle_rows")
    for a, b in zip(skip_rows, plain_rows):
        assert a["reward_mean"] == b["reward_mean"]
        for key in ("loss", "entropy", "grad_norm", "clip_ratio/region", "rollout_logp_gap/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    assert all(torch.allclose(skip_adapter[k], plain_adapter[k], atol=1e-5) for k in plain_adapter)


def test_killed_run_resumes_to_the_same_adapter_as_an_uninterrupted_one(tmp_path):
    settings = tiny_settings(tmp_path)
    full = make_trainer(settings, tmp_path / "full")
    full.train()

    part = make_trainer(settings, tmp_path / "part")
    part.train(max_steps=3)
    part.close()  # as the process's exit would: the run folder's lock goes with it
    part.close()
    shutil.rmtree(tmp_path / "part" / "checkpoints" / "step-000003")  # "killed" after step 3: the last save is step 2
    (tmp_path / "part" / "adapter").rename(tmp_path / "part" / "adapter-stale")
    # a kill mid-write leaves a temp folder behind, never a half checkpoint
    half = tmp_path / "part" / "checkpoints" / ".tmp-step-000004-1"
    half.mkdir()
    (half / "trainer_state.json").write_bytes(b"garbage")

    resumed = make_trainer(settings, tmp_path / "part", resume=True)
    assert resumed.step == 2
    resumed.train()
    ta, tb = adapter_tensors(tmp_path / "full"), adapter_tensors(tmp_path / "part")
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    steps = [json.loads(x)["step"] for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_an_fp8_base_trains_and_resumes_to_the_same_adapter(tmp_path):
    """quant.scheme fp8 on the CPU (its dequantized weights): the update moves the adapter, and a run killed after
    a checkpoint resumes to the uninterrupted run's adapter, bit for bit."""
    from qerl.quant.linear import QuantLinear

    settings = tiny_settings(tmp_path, quant={"scheme": "fp8"}, train={"steps": 3, "save_every": 1})
    full = make_trainer(settings, tmp_path / "full")
    layers = [m for m in full.model.modules() if isinstance(m, QuantLinear)]
    assert layers and {m.scheme for m in layers} == {"fp8"}
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in layers)
    full.train()
    lines = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert any(r["grad_norm"] > 0 for r in lines)  # LoRA learns through the frozen FP8 base
    assert any(t.abs().sum() > 0 for k, t in adapter_tensors(tmp_path / "full").items() if "lora_B" in k)
    part = make_trainer(settings, tmp_path / "part")
    part.train(max_steps=2)
    part.close()
    shutil.rmtree(tmp_path / "part" / "checkpoints" / "step-000002")  # "killed" after step 2: the last save is step 1
    resumed = make_trainer(settings, tmp_path / "part", resume=True)
    assert resumed.step == 1
    resumed.train()
    ta, tb = adapter_tensors(tmp_path / "full"), adapter_tensors(tmp_path / "part")
    assert all(torch.equal(ta[k], tb[k]) for k in ta)


def test_entropy_targeted_aqn_resumes_bit_exactly(tmp_path):
    """The schedule's sigma is state (it depends on every past step's entropy): it must survive the checkpoint."""
    settings = tiny_settings(tmp_path, train={"steps": 5},
                             aqn={"schedule": "entropy", "target_entropy": 3.2, "sigma_start": 0.02,
                                  "sigma_min": 0.005, "sigma_max": 0.08, "sigma_rate": 2.0})
    full = make_trainer(settings, tmp_path / "full")
    full.train()
    part = make_trainer(settings, tmp_path / "part")
    part.train(max_steps=3)
    part.close()  # as the process's exit would: the run folder's lock goes with it
    shutil.rmtree(tmp_path / "part" / "checkpoints" / "step-000003")  # "killed" after step 3: the last save is step 2

    def records(run):
        return [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    full_log = records("full")
    resumed = make_trainer(settings, tmp_path / "part", resume=True)
    assert resumed.step == 2 and resumed.sigma() == full_log[2]["sigma"]  # step 3's rollouts, as in the full run
    resumed.train()
    part_log = records("part")
    sigmas = [r["sigma"] for r in full_log]
    assert len(set(sigmas)) > 1, sigmas  # the schedule moved: a frozen sigma would prove nothing
    assert [r["sigma"] for r in part_log] == sigmas
    assert [r["entropy"] for r in part_log] == [r["entropy"] for r in full_log]
    ta, tb = adapter_tensors(tmp_path / "full"), adapter_tensors(tmp_path / "part")
    assert all(torch.equal(ta[k], tb[k]) for k in ta)


def test_existing_run_without_resume_is_refused(tmp_path):
    settings = tiny_settings(tmp_path, train={"steps": 2})
    with make_trainer(settings, tmp_path / "run") as trainer:
        trainer.train()
    with pytest.raises(FileExistsError, match="--resume"):
        make_trainer(settings, tmp_path / "run")


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "cispo", "sapo", "gspo"])
def test_reward_rises_on_a_learnable_task(tmp_path, loss_type):
    grpo = {"loss_type": "grpo", "importance_sampling_level": "sequence"} if loss_type == "gspo" else \
        {"loss_type": loss_type}
    settings = tiny_settings(tmp_path, train={"steps": 8, "save_every": 100},
                             rollout={"prompts_per_step": 4, "group_size": 8},
                             grpo={**grpo, "micro_batch_size": 16},
                             optim={"lr": 3e-2})
    trainer = make_trainer(settings, tmp_path / "run")
    trainer.train()
    rewards = [json.loads(x)["reward_mean"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-3:]) / 3
    assert last > first + 0.2, rewards  # a flipped advantage sign or a misaligned log-prob would fail this


def test_dynamic_sampling_keeps_only_informative_groups(tmp_path):
    settings = tiny_settings(tmp_path, grpo={"dynamic_sampling": True, "max_resample_rounds": 2},
                             train={"steps": 1, "rewards": {"tests.test_trainer:even_gold_reward": 1.0}})
    trainer = make_trainer(settings, tmp_path / "run")
    batch = trainer.keep_informative(trainer.score(trainer.rollout()))
    # every group's rewards are equal (they depend on the question only): nothing is kept after 3 rounds
    assert batch.extra["dynamic_sampling/rounds"] == 3
    assert len(batch.examples) == 0
    metrics = trainer.train_step()
    assert metrics.get("skipped") == 1.0


def test_a_skipped_step_leaves_the_learning_rate_schedule_alone_and_warns_nothing(tmp_path):
    """A step without an update (dynamic sampling kept no group) stepped the scheduler with no optimizer step before
    it: torch warned "lr_scheduler.step() before optimizer.step()" when that was the run's first step. The schedule
    counts updates, as transformers' Trainer steps its scheduler only after an optimizer step that ran."""
    import warnings

    from qerl.data import rewards

    settings = tiny_settings(tmp_path, grpo={"dynamic_sampling": True, "max_resample_rounds": 0},
                             optim={"warmup_steps": 2, "schedule": "cosine"},
                             train={"steps": 3, "rewards": {"tests.test_trainer:even_gold_reward": 1.0}})
    with warnings.catch_warnings(record=True) as caught, make_trainer(settings, tmp_path / "run") as trainer:
        warnings.simplefilter("always")
        assert trainer.train_step().get("skipped") == 1.0  # no group with a learning signal: no update
        first_lr = trainer.optimizer.param_groups[0]["lr"]
        trainer.scorer.reward_fn = rewards.combined_reward({"tests.test_trainer:ones_reward": 1.0})
        metrics = trainer.train_step()
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
            if "lr_scheduler" in str(w.message) or "/qerl/" in w.filename]
    assert not ours, ours
    assert "skipped" not in metrics and trainer.step == 2
    assert first_lr == pytest.approx(settings.optim.lr * lr_lambda(0, 2, 3, "cosine", 0.1))  # the first update's
    assert trainer.scheduler.last_epoch == 1  # one update so far


@pytest.mark.parametrize("keep, checkpointing, budget", [
    ("auto", "auto", 5 * 2**30),  # the spare memory the plan leaves
    ("auto", True, 0),  # a run that asked for memory first keeps none
    (False, "auto", 0),
    (True, True, 2**62),  # all, whatever the memory
])
def test_update_holds_dequantized_weights_in_the_memory_the_plan_leaves(tmp_path, monkeypatch, keep, checkpointing,
                                                                         budget):
    """model.keep_dequantized: the update's held-weights budget comes from the memory plan (faked here: the CPU
    has no spare GPU memory) and the setting, and the step logs what was held."""
    from qerl.model import recompute
    from qerl.rl import update as update_module

    budgets = []
    monkeypatch.setattr(recompute, "plan", lambda *a, **k: recompute.MemoryPlan(0, 5 * 2**30))

    @contextlib.contextmanager
    def recording(model, b):
        budgets.append(b)
        yield lambda: 3 * 2**29

    monkeypatch.setattr(update_module, "held_weights", recording)
    settings = tiny_settings(tmp_path, train={"steps": 1},
                             model={"keep_dequantized": keep, "gradient_checkpointing": checkpointing})
    make_trainer(settings, tmp_path / "run").train()
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert budgets == [budget] and row["held_weights_gib"] == 1.5


NOISY_ROLLOUTS = {"schedule": "entropy", "target_entropy": 3.0, "sigma_start": 0.05, "sigma_min": 0.01,
                  "sigma_max": 0.1}  # AQN noise from step 1 on: a rollout/trainer gap for the correction to act on


@pytest.mark.parametrize("grpo, aqn", [
    ({"loss_type": "cispo", "importance_sampling_level": "sequence", "top_entropy_quantile": 0.5,
      "correction": "mis", "correction_level": "sequence"}, {}),
    # μ = 2: both iterations mask by the sampling policy's entropies
    ({"loss_type": "sapo", "top_entropy_quantile": 0.3, "correction": "tis", "num_iterations": 2}, {}),
    ({"loss_type": "dr_grpo", "importance_sampling_level": "sequence", "correction": "mis",
      "correction_level": "sequence", "correction_cap": 1.05}, NOISY_ROLLOUTS),
], ids=["gspo-cispo-entropy-mis", "sapo-entropy-tis-mu2", "gspo-dr_grpo-mis"])
def test_the_losses_update_does_not_depend_on_the_micro_batching(tmp_path, grpo, aqn):
    """Micro-batches of 3 rows (cutting across the groups of 4) give the update of one micro-batch of all 8: the
    top-entropy mask takes the whole step's quantile, not each micro-batch's; the correction and the sequence-level
    ratios are per row. The loss's metrics reach the step's."""
    runs = []
    for micro in (8, 3):
        settings = tiny_settings(tmp_path, train={"steps": 1}, grpo={**grpo, "micro_batch_size": micro}, aqn=aqn)
        make_trainer(settings, tmp_path / str(micro)).train()
        runs.append(([json.loads(x) for x in (tmp_path / str(micro) / "metrics.jsonl").read_text().splitlines()],
                     adapter_tensors(tmp_path / str(micro))))
    (whole_rows, whole_adapter), (micro_rows, micro_adapter) = runs
    name = "mis_weight" if grpo["correction"] == "mis" else "tis_weight"
    keys = ["loss", "grad_norm", "ratio/mean", f"{name}/mean"]
    keys += ["entropy_mask/kept"] if "top_entropy_quantile" in grpo else []
    for a, b in zip(whole_rows, micro_rows):
        assert a["reward_mean"] == b["reward_mean"]
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    if "top_entropy_quantile" in grpo:  # about the quantile's share of the tokens (ties and interpolation aside)
        assert abs(whole_rows[0]["entropy_mask/kept"] - grpo["top_entropy_quantile"]) < 0.1
    assert abs(whole_rows[0]["ratio/mean"] - 1) < 0.05  # a mean over the μ iterations, not their sum
    if aqn:  # the noisy rollouts' sequences beyond the cap are dropped, and no more
        assert 0 < whole_rows[0]["mis_weight/masked"] < 1
    assert all(torch.allclose(micro_adapter[k], whole_adapter[k], atol=1e-5) for k in whole_adapter)


def test_correction_auto_turns_tis_on_only_where_rollouts_compute_in_less_precision(tmp_path, caplog):
    """grpo.correction: auto (the default) is none where the sampler computes as the update does (the CPU, 4-bit
    rollouts), and tis at the default cap, said in one log line, where it does not (FP8 weight copies or an FP8 KV
    cache on a GPU; here layers marked as the GPU plan marks them); an explicit choice is kept."""
    from qerl.quant.linear import QuantLinear, quantize_model

    def trainer(out, marked, **sections):
        tok = char_tokenizer()
        model = tiny_model(tok)
        quantize_model(model, "nvfp4")
        model.requires_grad_(False)
        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.fp8_weights = marked  # what plan_fp8_weights marks on a GPU with FP8 tensor cores
        return Trainer(tiny_settings(tmp_path, **sections), tmp_path / out, model=model, tokenizer=tok, progress=False)

    with trainer("plain", False) as t:
        assert t.loss_cfg.correction == "none" and not t.rollout_backend.reduced_precision()
    caplog.set_level(logging.INFO, logger="qerl.rl.trainer")
    with trainer("fp8", True) as t:
        assert (t.loss_cfg.correction, t.loss_cfg.correction_cap) == ("tis", 2.0)
    assert [r.getMessage() for r in caplog.records if "grpo.correction auto" in r.getMessage()] == [
        "grpo.correction auto: tis at cap 2.0, since the rollouts run on the NVFP4 base's FP8 weight copies "
        "(quant.fp8_weights) (log-prob gap to the update over 0.03 nats/token; set grpo.correction to choose)"]
    with trainer("chosen", True, grpo={"correction": "none"}) as t:
        assert t.loss_cfg.correction == "none"


def test_a_non_finite_gradient_skips_the_optimizer_step_and_leaves_the_adapters_finite(tmp_path, caplog):
    """A NaN in the sampler's log-probs of a loss token (on 2026-12-02: the GPU sampling kernel's, at forced EOS)
    under the rollout correction made the loss and the gradient NaN, and one AdamW step then made every LoRA weight
    NaN for good. The step is skipped instead, said in the log and in update/nonfinite_skipped; the next step whose
    gradient is finite trains as usual."""
    settings = tiny_settings(tmp_path, grpo={"correction": "tis"}, train={"steps": 2, "save_every": 2})
    with make_trainer(settings, tmp_path / "run") as trainer:
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        rollout = trainer.rollout

        def poisoned(*args, **kwargs):
            batch = rollout(*args, **kwargs)
            if trainer.step == 1:
                batch.samples.logprobs[0][0] = float("nan")  # one loss token's sampler log-prob
            return batch

        trainer.rollout = poisoned
        caplog.set_level(logging.WARNING, logger="qerl.rl.update")
        trainer.step = 1
        first = trainer.train_step()
        after = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        assert first["update/nonfinite_skipped"] == 1 and first["grad_norm"] != first["grad_norm"]  # NaN
        assert trainer.scheduler.last_epoch == 0  # the learning-rate schedule counts the updates that ran
        assert all(torch.equal(before[n], after[n]) for n in before)
        assert any("optimizer step skipped" in r.getMessage() for r in caplog.records)
        trainer.step = 2
        second = trainer.train_step()
        assert second["update/nonfinite_skipped"] == 0
        assert all(torch.isfinite(p).all() for p in trainer.model.parameters() if p.requires_grad)
        assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if p.requires_grad)
class _AnyBraces:
    """A tool-call format for the character model: a turn's call ends at '}', whatever it wrote (it writes '}' now
    and then), and calls the tool `one`."""

    def __new__(cls):
        from qerl.rollout.tool_calls import ToolCallFormat

        class Braces(ToolCallFormat):
            def parse(self, text):
                return "one", {}

        return Braces(open="{", close="}")


def one() -> str:
    """One."""
    return "1"


def with_tools(trainer):
    """The trainer's rollouts calling `one` (answer "1") in the character model's words (glue "=" ... "?")."""
    from qerl.rollout.multi_turn import ToolUse
    from qerl.rollout.tool_calls import ToolTurn

    trainer.tool_use = ToolUse({"one": one}, max_turns=3, format=_AnyBraces(), turn=ToolTurn("=", "?"))
    return trainer


def test_multi_turn_steps_mask_the_tool_turns_and_resume_bit_exactly(tmp_path):
    """rollout.tools: the step's rollouts call tools (counted in the metrics), the update trains on the generated
    tokens only (the batch's loss mask is 0 at the tool turns), and a resumed run ends at the uninterrupted one's
    adapter, bit for bit (rollouts are regenerated from the seeds: no tool state is checkpointed)."""
    settings = tiny_settings(tmp_path, rollout={"max_new_tokens": 24, "tools": ["tests.test_trainer:one"],
                                                "max_tool_calling_iterations": 3})
    full = with_tools(make_trainer(settings, tmp_path / "full"))
    batch = full.rollout()
    masks = batch.samples.generated_mask
    assert any((~m).any() for m in masks)
    padded = batch.padded(full.pad_id)
    for i, m in enumerate(masks):
        assert padded["mask"][i, :len(m)].bool().tolist() == m.tolist()
    full.close()
    full = with_tools(make_trainer(settings, tmp_path / "full2"))
    full.train()
    rows = [json.loads(x) for x in (tmp_path / "full2" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["rollout/tool_calls"] for r in rows) > 0
    part = with_tools(make_trainer(settings, tmp_path / "part"))
    part.train(max_steps=2)
    part.close()
    resumed = with_tools(make_trainer(settings, tmp_path / "part", resume=True))
    assert resumed.step == 2
    resumed.train()
    ta, tb = adapter_tensors(tmp_path / "full2"), adapter_tensors(tmp_path / "part")
    assert all(torch.equal(ta[k], tb[k]) for k in ta)


class CounterEnv:
    """Written for TRL's environment_factory: a counter per rollout row, reset with the row's data columns; its
    tool counts the row's calls; `get_reward` is TRL's reserved method, no tool (it has no docstring to be one)."""

    def reset(self, question, **row):
        self.question, self.counter = question, 0

    def increment(self) -> str:
        """Add one to the counter.

        Returns:
            The counter after the call.
        """
        self.counter += 1
        return str(self.counter)

    def get_reward(self):
        return float(self.counter)


def counter_reward(environments, **kwargs):
    """A TRL reward reading each completion's environment, as TRL passes them."""
    return [float(env.counter) for env in environments]


def test_an_environment_keeps_each_rows_state_and_the_reward_reads_it(tmp_path):
    """rollout.environment: one environment per row, reset with its data row; its tool's state is the row's own
    (the counter equals that completion's own tool turns), a TRL reward gets the rows' environments, and the
    environment's get_reward is a reward of its own."""
    import dataclasses

    from qerl.rollout.tool_calls import ToolCallFormat, ToolTurn

    class Increments(ToolCallFormat):  # the character model's '}' calls `increment`
        def parse(self, text):
            return "increment", {}

    settings = tiny_settings(tmp_path, rollout={"max_new_tokens": 24, "environment": "tests.test_trainer:CounterEnv",
                                                "max_tool_calling_iterations": 3},
                             train={"rewards": {"tests.test_trainer:counter_reward": 1.0}, "steps": 1})
    trainer = make_trainer(settings, tmp_path / "run")
    assert list(trainer.tool_use.tools) == ["increment"]  # the environment's tools, reset and get_reward reserved
    trainer.tool_use = dataclasses.replace(trainer.tool_use, format=Increments(open="{", close="}"),
                                           turn=ToolTurn("=", "?"))
    batch = trainer.score(trainer.rollout())
    turns = [int((m[1:] < m[:-1]).sum() + (~m[:1]).sum()) for m in batch.samples.masks()]  # runs of tool tokens
    assert sum(turns) > 0 and len(set(turns)) > 1  # calls happened, not as many in every row
    # counter_reward, and get_reward as a reward source of its own (weight 1, named after the class, as TRL does)
    assert {k: v.tolist() for k, v in batch.reward_terms.items()} == {"counter_reward": [float(n) for n in turns],
                                                                      "CounterEnv": [float(n) for n in turns]}
    assert batch.rewards.tolist() == [2.0 * n for n in turns]
    envs = batch.samples.environments
    assert [e.instance.question for e in envs] == [ex.question for ex in batch.examples for _ in range(4)]
    assert [e.reward(None) for e in envs] == [float(n) for n in turns]  # TRL's get_reward, as qerl's reward
    trainer.close()


def test_an_environment_that_does_not_resolve_is_one_line_naming_it(tmp_path):
    from qerl.params_yaml import ConfigError

    with pytest.raises(ValueError, match=r"^rollout.environment = 'tests.test_trainer:Nope': environment "
                                         r"'tests.test_trainer:Nope': tests.test_trainer.Nope is missing"):
        make_trainer(tiny_settings(tmp_path, rollout={"environment": "tests.test_trainer:Nope"}), tmp_path / "a")
    with pytest.raises(ValueError, match=r"^rollout.environment = 'tests.test_trainer:ones_reward': environment "
                                         r"'ones_reward': its factory raised TypeError"):
        make_trainer(tiny_settings(tmp_path, rollout={"environment": "tests.test_trainer:ones_reward"}),
                     tmp_path / "b")
    with pytest.raises(ValueError, match=r"reward 'tests.test_trainer:counter_reward' needs 'environments'.* come "
                                         "with rollout.environment"):
        make_trainer(tiny_settings(tmp_path, train={"rewards": {"tests.test_trainer:counter_reward": 1.0}}),
                     tmp_path / "c")
    with pytest.raises(ConfigError, match=r"environment = 'CounterEnv': name it as 'package.module:function'"):
        tiny_settings(tmp_path, rollout={"environment": "CounterEnv"})
    with pytest.raises(ConfigError, match="environment: backend 'vllm' cannot pause a row at a tool call"):
        tiny_settings(tmp_path, rollout={"environment": "tests.test_trainer:CounterEnv", "backend": "vllm"})


def test_tools_that_do_not_resolve_or_a_backend_without_multi_turn_are_refused_in_one_line(tmp_path):
    from qerl.params_yaml import ConfigError

    with pytest.raises(ValueError, match=r"rollout.tools = \['tests.test_trainer:nope'\]: .*no attribute|missing"):
        make_trainer(tiny_settings(tmp_path, rollout={"tools": ["tests.test_trainer:nope"]}), tmp_path / "a")
    with pytest.raises(ValueError, match=r"rollout.tools = \['tests.test_trainer:ones_reward'\]: tool ones_reward .*Args"):
        make_trainer(tiny_settings(tmp_path, rollout={"tools": ["tests.test_trainer:ones_reward"]}), tmp_path / "b")
    with pytest.raises(ConfigError, match="backend 'vllm' cannot pause a row at a tool call"):
        tiny_settings(tmp_path, rollout={"tools": ["tests.test_trainer:ones_reward"], "backend": "vllm"})
    with pytest.raises(ConfigError, match="overprovision"):
        tiny_settings(tmp_path, rollout={"tools": ["tests.test_trainer:ones_reward"], "overprovision": 0.5})
