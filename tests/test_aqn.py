"""Adaptive Quantization Noise: schedule, where the noise goes, exact removal, determinism."""

import math

import pytest
import torch
from torch import nn

from qerl.config import AQNSettings
from qerl.model.aqn import AQNSchedule, EntropyTargetedSchedule, NoiseInjector, build_schedule, norm_weights


def reference_sigma(step: int, total_steps: int, start: float, end: float, num_stages: int) -> float:
    """The NVlabs/QeRL reference (noise_scheduler.get_sigma_by_step + grpo_trainer's sigma_trend),
    float arithmetic and all."""
    trend = [start * (end / start) ** (i / (num_stages - 2)) for i in range(num_stages - 1)]
    step = min(step, total_steps)
    interval = int(step // (total_steps / num_stages))
    return 0.0 if interval == 0 else trend[min(interval - 1, num_stages - 2)]


# ----------------------------------------------------------------------------- schedule


def test_schedule_default_layout():
    s = AQNSchedule(sigma_start=1e-2, sigma_end=5e-4, num_stages=10, total_steps=100)
    assert [s.sigma(t) for t in range(10)] == [0.0] * 10  # first stage exactly noise-free
    assert s.sigma(10) == s.sigma(19) == 1e-2  # first noisy stage: sigma_start
    assert s.sigma(50) == pytest.approx(math.sqrt(1e-2 * 5e-4))  # stage 5: exponent 4/8, geometric middle
    assert s.sigma(90) == s.sigma(99) == s.sigma(100) == s.sigma(10_000) == pytest.approx(5e-4)
    assert [s.stage(t) for t in (0, 9, 10, 55, 99, 500)] == [0, 0, 1, 5, 9, 9]
    # geometric: a constant ratio (end/start)^(1/8) between consecutive noisy stages
    sig = [s.sigma(10 * k) for k in range(1, 10)]
    for a, b in zip(sig, sig[1:]):
        assert b / a == pytest.approx((5e-4 / 1e-2) ** (1 / 8))


@pytest.mark.parametrize("num_stages, total_steps", [(10, 100), (5, 37), (3, 600), (4, 1000), (7, 50)])
def test_schedule_matches_reference_formula(num_stages, total_steps):
    s = AQNSchedule(sigma_start=5e-2, sigma_end=5e-4, num_stages=num_stages, total_steps=total_steps)
    for step in range(total_steps + 5):
        expected = reference_sigma(step, total_steps, 5e-2, 5e-4, num_stages)
        assert s.sigma(step) == pytest.approx(expected, rel=1e-12, abs=0), step
    assert s.sigma(0) == 0.0
    assert s.sigma(total_steps - 1) == pytest.approx(5e-4)


def test_schedule_stage_boundaries_are_exact():
    # 10 * 9 / 30 = 3 exactly; the reference's float 10 // (30 / 9) gives 2.
    s = AQNSchedule(num_stages=9, total_steps=30)
    assert s.stage(9) == 2 and s.stage(10) == 3


def test_entropy_schedule_raises_sigma_below_target_and_lowers_it_above_within_bounds():
    s = EntropyTargetedSchedule(target_entropy=1.0, sigma_start=1e-2, sigma_min=4e-3, sigma_max=3e-2, rate=2.0)
    seen = [s.sigma(0)]
    for entropy in (0.5, 0.5, 0.5, 1.5, 1.0, 2.0, 2.0, 2.0):  # at the target counts as "above": noise withdraws
        s.observe(entropy)
        seen.append(s.sigma(len(seen)))
    assert seen == [1e-2, 2e-2, 3e-2, 3e-2, 1.5e-2, 7.5e-3, 4e-3, 4e-3, 4e-3]


def test_entropy_schedule_state_round_trips_and_rejects_bad_settings():
    a = EntropyTargetedSchedule(target_entropy=1.0, rate=1.3)
    for entropy in (0.2, 0.4, 3.0):
        a.observe(entropy)
    b = EntropyTargetedSchedule(target_entropy=1.0, rate=1.3)
    b.load_state_dict(a.state_dict())
    assert b.sigma(3) == a.sigma(3) != 1e-2
    for bad in (dict(target_entropy=0.0), dict(target_entropy=1.0, rate=1.0),
                dict(target_entropy=1.0, sigma_start=1.0, sigma_max=0.1)):
        with pytest.raises(ValueError):
            EntropyTargetedSchedule(**bad)


def test_build_schedule_follows_the_settings():
    assert build_schedule(AQNSettings(enabled=False), 10) is None
    assert build_schedule(AQNSettings(sigma_start=0, sigma_end=0), 10) is None  # both zero: another "off"
    assert isinstance(build_schedule(AQNSettings(), 10), AQNSchedule)
    entropy = build_schedule(AQNSettings(schedule="entropy", target_entropy=0.7, sigma_rate=2.0), 10)
    assert isinstance(entropy, EntropyTargetedSchedule) and entropy.target_entropy == 0.7 and entropy.rate == 2.0


def test_schedule_degenerate_stage_counts_and_validation():
    assert {AQNSchedule(num_stages=1, total_steps=10).sigma(t) for t in range(20)} == {0.0}
    two = AQNSchedule(sigma_start=1e-2, sigma_end=1e-3, num_stages=2, total_steps=10)
    assert [two.sigma(t) for t in (0, 4, 5, 9, 50)] == [0.0, 0.0, 1e-2, 1e-2, 1e-2]
    with pytest.raises(ValueError):
        AQNSchedule(total_steps=0)
    with pytest.raises(ValueError):
        AQNSchedule().sigma(-1)


# ----------------------------------------------------------------------------- models


class RMSNorm(nn.Module):
    """Stand-in with the same class-name convention as qerl.model.transformer.RMSNorm."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class TinyBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.input_layernorm = RMSNorm(dim)
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.other_norm = nn.LayerNorm(dim)  # not an RMSNorm: must be left alone


class TinyModel(nn.Module):
    def __init__(self, dim: int = 16, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(TinyBlock(dim) for _ in range(layers))
        self.norm = RMSNorm(dim)


def tiny_llama(dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norm weights, so "restored" means more than "all ones"
        for _, w in norm_weights(model):
            w.uniform_(0.5, 1.5)
    return model.to(dtype)


def snapshot(targets):
    return [w.detach().clone() for _, w in targets]


# ----------------------------------------------------------------------------- selection


def test_norm_weights_finds_rmsnorms_by_class_name():
    names = [n for n, _ in norm_weights(TinyModel())]
    assert names == ["layers.0.input_layernorm.weight", "layers.1.input_layernorm.weight", "norm.weight"]
    assert [n for n, _ in norm_weights(TinyModel(), include_final_norm=False)] == names[:2]


def test_norm_weights_on_transformers_llama():
    model = tiny_llama()
    names = [n for n, _ in norm_weights(model)]
    assert names == [
        "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
        "model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
        "model.norm.weight",
    ]
    assert "model.norm.weight" not in [n for n, _ in norm_weights(model, include_final_norm=False)]


def test_per_head_qk_norms_are_opt_in():
    model = TinyModel()
    model.layers[0].q_norm = RMSNorm(4)
    assert "layers.0.q_norm.weight" not in [n for n, _ in norm_weights(model)]
    assert "layers.0.q_norm.weight" in [n for n, _ in norm_weights(model, include_qk_norm=True)]


# ----------------------------------------------------------------------------- noise


def test_qkv_share_one_draw_and_gate_up_share_another():
    model = tiny_llama()
    layer = model.model.layers[0]
    seen = {}
    readers = {layer.self_attn: ("q_proj", "k_proj", "v_proj"), layer.mlp: ("gate_proj", "up_proj")}
    for parent, names in readers.items():
        for name in names:
            getattr(parent, name).register_forward_pre_hook(lambda m, a, n=name: seen.__setitem__(n, a[0]))
    ids = torch.randint(0, 64, (2, 8))

    with torch.no_grad():
        model(ids)
        clean_q = seen["q_proj"]
        injector = NoiseInjector(model)
        w_in, w_post = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        clean_in, clean_post = w_in.clone(), w_post.clone()
        with injector.noisy(sigma=0.05, seed=1):
            model(ids)
            z_in, z_post = w_in - clean_in, w_post - clean_post

    assert torch.equal(seen["q_proj"], seen["k_proj"]) and torch.equal(seen["q_proj"], seen["v_proj"])
    assert torch.equal(seen["gate_proj"], seen["up_proj"])
    # q/k/v see the clean input scaled per channel by (w + z) / w: one noise vector for all three.
    torch.testing.assert_close(seen["q_proj"], clean_q * (clean_in + z_in) / clean_in)
    assert not torch.equal(seen["q_proj"], clean_q)
    # Attention and MLP norms get independent vectors.
    assert z_in.abs().min() > 0 and not torch.allclose(z_in, z_post)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_removal_is_bit_exact_after_many_cycles(dtype):
    model = tiny_llama(dtype)
    injector = NoiseInjector(model)
    original = snapshot(injector.targets)
    for i in range(100):
        injector.apply(sigma=1e-2, seed=i)
        assert any(not torch.equal(w, o) for (_, w), o in zip(injector.targets, original))
        injector.remove()
    assert all(torch.equal(w, o) for (_, w), o in zip(injector.targets, original))
    assert all(w.dtype == dtype for _, w in injector.targets)


def test_removal_on_exception_inside_noisy():
    model = tiny_llama(torch.bfloat16)
    injector = NoiseInjector(model)
    original = snapshot(injector.targets)
    with pytest.raises(KeyError):
        with injector.noisy(sigma=1e-2, seed=0):
            raise KeyError("boom")
    assert not injector.active
    assert all(torch.equal(w, o) for (_, w), o in zip(injector.targets, original))


def test_storage_is_updated_in_place():
    injector = NoiseInjector(tiny_llama(torch.bfloat16))
    pointers = [w.data_ptr() for _, w in injector.targets]
    injector.apply(sigma=1e-2, seed=0)
    assert [w.data_ptr() for _, w in injector.targets] == pointers
    injector.remove()
    assert [w.data_ptr() for _, w in injector.targets] == pointers


def test_same_seed_same_noise_different_seed_different_noise():
    model = TinyModel(dim=64)
    injector = NoiseInjector(model)
    noisy = []
    for seed in (7, 7, 8):
        with injector.noisy(sigma=1e-2, seed=seed):
            noisy.append(snapshot(injector.targets))
    assert all(torch.equal(a, b) for a, b in zip(noisy[0], noisy[1]))
    assert all(not torch.equal(a, c) for a, c in zip(noisy[0], noisy[2]))
    # each norm gets its own vector, not one vector repeated
    assert not torch.equal(noisy[0][0], noisy[0][1])


def test_noise_is_zero_mean_with_std_sigma():
    model = nn.ModuleList([RMSNorm(50_000)])  # norms only: a 50k-wide TinyModel would hold 3 huge linears
    injector = NoiseInjector(model)
    sigma = 1e-2
    with injector.noisy(sigma=sigma, seed=0):
        noise = model[0].weight.detach() - 1.0
    assert noise.std().item() == pytest.approx(sigma, rel=0.02)  # sampling error ~0.3%
    assert abs(noise.mean().item()) < 4 * sigma / math.sqrt(noise.numel())


def test_zero_sigma_is_a_no_op_and_double_apply_is_an_error():
    model = TinyModel()
    injector = NoiseInjector(model)
    original = snapshot(injector.targets)
    with injector.noisy(sigma=0.0, seed=0):
        assert not injector.active
        assert all(torch.equal(w, o) for (_, w), o in zip(injector.targets, original))

    injector.apply(sigma=1e-2, seed=0)
    with pytest.raises(RuntimeError):
        injector.apply(sigma=1e-2, seed=1)  # stacking noise would lose the clean snapshot
    injector.remove()
    injector.remove()  # removing twice is harmless
    assert all(torch.equal(w, o) for (_, w), o in zip(injector.targets, original))
    with pytest.raises(ValueError):
        NoiseInjector(nn.Linear(2, 2))  # nothing to perturb
