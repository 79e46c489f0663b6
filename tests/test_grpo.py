"""GRPO/DAPO/Dr. GRPO loss: hand-computed values, clipping, KL, masking, accumulation, TIS."""

import math

import pytest
import torch

from qerl.rl.grpo import (
    at_or_above,
    LossConfig,
    entropy_from_logits,
    entropy_threshold,
    head_log_probs,
    group_advantages,
    informative_groups,
    loss_mask,
    policy_loss,
    selective_log_softmax,
)

# Shared fixture: B=2 sequences, T=3 tokens, eps_low=0.2 / eps_high=0.28 -> clip range [0.8, 1.28].
#   ratios     row 0: 1.5  0.5  1.0   (A = +1)
#              row 1: 1.1  0.7  1.3   (A = -2, last token is padding)
# per-token loss -min(r*A, clip(r)*A):
#   row 0: r=1.5 -> -min(1.5, 1.28) = -1.28 ; r=0.5 -> -min(0.5, 0.8) = -0.5 ; r=1.0 -> -1.0
#   row 1: r=1.1 -> -min(-2.2, -2.2) = 2.2  ; r=0.7 -> -min(-1.4, -1.6) = 1.6 ; (r=1.3 masked)
RATIOS = [[1.5, 0.5, 1.0], [1.1, 0.7, 1.3]]
ADVANTAGES = [1.0, -2.0]
MASK = [[1, 1, 1], [1, 1, 0]]


def make_inputs(requires_grad: bool = False):
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2]], dtype=torch.float64)
    logp = (old + torch.log(torch.tensor(RATIOS, dtype=torch.float64))).requires_grad_(requires_grad)
    return logp, old, torch.tensor(ADVANTAGES, dtype=torch.float64), torch.tensor(MASK)


@pytest.mark.parametrize(
    "loss_type, extra, expected",
    [
        # mean per sequence, then over sequences: ((-1.28-0.5-1.0)/3 + (2.2+1.6)/2) / 2
        ("grpo", {}, (-2.78 / 3 + 3.8 / 2) / 2),
        # all tokens: (-2.78 + 3.8) / 5 tokens
        ("dapo", {}, 1.02 / 5),
        # constant normaliser B * L = 2 * 4
        ("dr_grpo", {"max_completion_length": 4}, 1.02 / 8),
    ],
)
def test_loss_variants_match_hand_computed_values(loss_type, extra, expected):
    logp, old, adv, mask = make_inputs()
    loss, _ = policy_loss(logp, old, adv, mask, LossConfig(loss_type=loss_type, **extra))
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_clip_metrics_count_only_the_side_that_binds():
    logp, old, adv, mask = make_inputs()
    _, m = policy_loss(logp, old, adv, mask, LossConfig())
    # low: r < 0.8 with A < 0 -> only row 1's r=0.7 (row 0's r=0.5 has A > 0): 1 of 5 tokens.
    # high: r > 1.28 with A > 0 -> only row 0's r=1.5 (row 1's r=1.3 is padding): 1 of 5.
    assert m["clip_ratio/low"] == pytest.approx(1 / 5)
    assert m["clip_ratio/high"] == pytest.approx(1 / 5)
    assert m["clip_ratio/region"] == pytest.approx(2 / 5)
    assert m["ratio/mean"] == pytest.approx((1.5 + 0.5 + 1.0 + 1.1 + 0.7) / 5)
    assert "kl" not in m and "rollout_logp_gap/mean" not in m


def test_clipped_tokens_get_no_gradient_and_unclipped_ones_do():
    logp, old, adv, mask = make_inputs(requires_grad=True)
    loss, _ = policy_loss(logp, old, adv, mask, LossConfig(loss_type="dapo"))
    loss.backward()
    g = logp.grad
    # d/dlogp of -(r*A)/5 is -r*A/5 where the unclipped branch is active.
    assert g[0, 0] == 0  # r=1.5 > 1.28 with A>0: clipped high
    assert g[1, 1] == 0  # r=0.7 < 0.8 with A<0: clipped low
    assert g[0, 1].item() == pytest.approx(-0.5 * 1 / 5)  # r=0.5, A>0: below the range, not clipped
    assert g[0, 2].item() == pytest.approx(-1.0 * 1 / 5)
    assert g[1, 0].item() == pytest.approx(-1.1 * -2 / 5)
    assert g[1, 2] == 0  # padding


def test_kl_value_and_gradient_direction():
    logp = torch.log(torch.tensor([[0.25, 0.5]], dtype=torch.float64)).requires_grad_(True)
    ref = torch.log(torch.tensor([[0.5, 0.25]], dtype=torch.float64))
    cfg = LossConfig(loss_type="dapo", beta=0.1)
    no_advantage = torch.zeros(1, dtype=torch.float64)
    loss, m = policy_loss(logp, None, no_advantage, torch.ones(1, 2), cfg, ref_logp=ref)
    # k3 = exp(d) - d - 1 with d = ref - logp = +-ln 2:  (2 - ln2 - 1) and (0.5 + ln2 - 1)
    kl = [1 - math.log(2), math.log(2) - 0.5]
    assert m["kl"] == pytest.approx(sum(kl) / 2)
    assert loss.item() == pytest.approx(0.1 * sum(kl) / 2)  # zero advantages: only the KL term
    loss.backward()
    # Gradient descent must move logp toward ref: up where logp < ref, down where logp > ref.
    assert logp.grad[0, 0] < 0 and logp.grad[0, 1] > 0
    # dk3/dlogp = 1 - exp(ref - logp): (1 - 2) and (1 - 0.5), times beta / 2 tokens.
    assert logp.grad[0].tolist() == pytest.approx([0.1 * -1 / 2, 0.1 * 0.5 / 2])


def test_kl_needs_beta_and_ref():
    logp, old, adv, mask = make_inputs()
    base, _ = policy_loss(logp, old, adv, mask, LossConfig())
    ref = logp - 1.0
    no_beta, m = policy_loss(logp, old, adv, mask, LossConfig(beta=0.0), ref_logp=ref)
    assert no_beta.item() == base.item() and "kl" not in m
    with_beta, _ = policy_loss(logp, old, adv, mask, LossConfig(beta=0.5), ref_logp=ref)
    assert with_beta.item() == pytest.approx(base.item() + 0.5 * (math.exp(-1) + 1 - 1))


def test_padding_values_do_not_leak():
    logp, old, adv, mask = make_inputs()
    garbage = logp.detach().clone()
    garbage[1, 2] = float("nan")  # the padding token
    loss, _ = policy_loss(garbage, old, adv, mask, LossConfig())
    rollout = old.clone()
    rollout[1, 2] = float("-inf")
    loss_tis, m = policy_loss(logp, old, adv, mask, LossConfig(tis_cap=2.0), rollout_logp=rollout)
    assert loss.item() == pytest.approx(1.02 / 5) and loss_tis.item() == pytest.approx(1.02 / 5)
    assert math.isfinite(m["rollout_logp_gap/max"])


def test_mask_truncated_drops_whole_sequences():
    logp, old, adv, mask = make_inputs()
    truncated = torch.tensor([False, True])
    cfg = LossConfig(loss_type="dapo", mask_truncated=True)
    loss, m = policy_loss(logp, old, adv, mask, cfg, truncated=truncated)
    assert loss.item() == pytest.approx(-2.78 / 3)  # only row 0's three tokens remain
    assert m["clip_ratio/low"] == 0 and m["clip_ratio/high"] == pytest.approx(1 / 3)
    assert loss_mask(mask, cfg, truncated).sum().item() == 3
    # Without the flag the truncated row counts; with the flag but no flags given it is an error.
    plain, _ = policy_loss(logp, old, adv, mask, LossConfig(loss_type="dapo"), truncated=truncated)
    assert plain.item() == pytest.approx(1.02 / 5)
    with pytest.raises(ValueError):
        policy_loss(logp, old, adv, mask, cfg)


def test_dapo_gradient_accumulation_equals_one_batch():
    torch.manual_seed(0)
    B, T = 4, 6
    logp = torch.randn(B, T, dtype=torch.float64).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(B, T, dtype=torch.float64)
    adv = torch.randn(B, dtype=torch.float64)
    lengths = torch.tensor([6, 1, 4, 2])  # unequal lengths: plain per-micro-batch means would differ
    mask = (torch.arange(T) < lengths[:, None]).long()
    cfg = LossConfig(loss_type="dapo")

    full, _ = policy_loss(logp, old, adv, mask, cfg)
    (full_grad,) = torch.autograd.grad(full, logp)

    total_tokens = float(loss_mask(mask, cfg).sum())
    halves = [slice(0, 2), slice(2, 4)]
    parts = [
        policy_loss(logp[s], old[s], adv[s], mask[s], cfg, token_normalizer=total_tokens)[0] for s in halves
    ]
    (acc_grad,) = torch.autograd.grad(sum(parts), logp)
    assert sum(parts).item() == pytest.approx(full.item(), abs=1e-12)
    torch.testing.assert_close(acc_grad, full_grad, rtol=0, atol=1e-12)


def test_tis_weights_are_capped_and_detached():
    logp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    # exp(old - rollout): exp(ln 3) = 3 capped to 2, and exp(ln 0.5) = 0.5
    rollout = torch.tensor([[-math.log(3), math.log(2)]], dtype=torch.float64)
    adv = torch.ones(1, dtype=torch.float64)
    cfg = LossConfig(loss_type="dapo", tis_cap=2.0)
    loss, m = policy_loss(logp, old, adv, torch.ones(1, 2), cfg, rollout_logp=rollout)
    # ratio 1 everywhere: per-token loss -1, weighted by (2, 0.5), over 2 tokens
    assert loss.item() == pytest.approx(-(2 + 0.5) / 2)
    assert m["tis_weight/mean"] == pytest.approx(1.25)
    assert m["rollout_logp_gap/mean"] == pytest.approx((math.log(3) + math.log(2)) / 2)
    assert m["rollout_logp_gap/max"] == pytest.approx(math.log(3))
    loss.backward()
    # weight is a constant: grad = -A * r * w / 2
    assert logp.grad[0].tolist() == pytest.approx([-2 / 2, -0.5 / 2])
    with pytest.raises(ValueError):
        policy_loss(logp, old, adv, torch.ones(1, 2), cfg)  # TIS without rollout log-probs


def test_gap_metrics_without_tis_leave_the_loss_alone():
    logp, old, adv, mask = make_inputs()
    loss, m = policy_loss(logp, old, adv, mask, LossConfig(), rollout_logp=old - 0.1)
    assert loss.item() == pytest.approx(1.02 / 5)
    assert m["rollout_logp_gap/mean"] == pytest.approx(0.1)
    assert "tis_weight/mean" not in m


def test_group_advantages_with_and_without_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    # group 0: mean 0.5, Bessel std sqrt((4 * 0.25) / 3) = sqrt(1/3); group 1: all equal -> 0
    g = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert group_advantages(rewards, 4).tolist() == pytest.approx([g, -g, -g, g, 0, 0, 0, 0], rel=1e-6)
    assert group_advantages(rewards, 4, scale="none").tolist() == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    # batch std: mean 0.75, squared deviations 6 * 0.0625 + 2 * 0.5625 = 1.5, / 7
    b = 0.5 / (math.sqrt(1.5 / 7) + 1e-4)
    assert group_advantages(rewards, 4, scale="batch").tolist() == pytest.approx([b, -b, -b, b, 0, 0, 0, 0], rel=1e-6)
    with pytest.raises(ValueError):
        group_advantages(rewards, 3)


def test_informative_groups():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.25])
    assert informative_groups(rewards, 3).tolist() == [False, True, False, True]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_selective_log_softmax_matches_log_softmax_gather(dtype):
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 5, 50, dtype=torch.float64)).to(dtype).requires_grad_(True)
    ids = torch.randint(0, 50, (2, 5))
    upstream = torch.randn(2, 5, dtype=torch.float64)

    out = selective_log_softmax(logits, ids)
    (grad,) = torch.autograd.grad((out.double() * upstream).sum(), logits)

    ref_logits = logits.detach().double().requires_grad_(True)
    ref = ref_logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    (ref_grad,) = torch.autograd.grad((ref * upstream).sum(), ref_logits)

    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = 1e-12 if dtype == torch.float64 else 1e-5  # exact up to the compute dtype, even for bf16 input
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=tol)
    grad_tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype]  # bf16 grads are bf16
    torch.testing.assert_close(grad.double(), ref_grad, rtol=grad_tol, atol=grad_tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("frozen_head", [False, True], ids=["head-trained", "head-frozen"])
@pytest.mark.parametrize("want_entropy", [True, False])
def test_head_log_probs_match_the_full_logits_path(dtype, temperature, frozen_head, want_entropy):
    """Both backward paths: a trained head (logits recomputed in backward) and the trainer's frozen head (each
    token's derivative taken in forward), with and without the entropies."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 8, dtype=torch.float64).to(dtype).requires_grad_(True)
    weight = torch.randn(50, 8, dtype=torch.float64).to(dtype).requires_grad_(not frozen_head)
    ids = torch.randint(0, 50, (2, 5))
    upstream = torch.randn(2, 5, dtype=torch.float64)
    inputs = (hidden,) if frozen_head else (hidden, weight)

    # chunk_size 3 does not divide the 10 tokens: the last chunk is short
    logp, entropy = head_log_probs(hidden, weight, ids, temperature, want_entropy=want_entropy, chunk_size=3)
    grads = torch.autograd.grad((logp.double() * upstream).sum(), inputs)

    logits = torch.nn.functional.linear(hidden, weight)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    ref = selective_log_softmax(logits, ids)
    ref_grads = torch.autograd.grad((ref.double() * upstream).sum(), inputs)

    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(logp, ref, rtol=0, atol=tol)
    p = logits.detach().double().softmax(-1)
    if want_entropy:
        torch.testing.assert_close(entropy.double(), -(p * p.log()).sum(-1), rtol=0, atol=max(tol, 1e-5))
    else:
        assert entropy is None
    for grad, ref_grad in zip(grads, ref_grads):
        assert grad.dtype == dtype
        torch.testing.assert_close(grad.double(), ref_grad.double(), rtol=tol, atol=tol)
    assert head_log_probs(hidden, weight, ids)[1] is None


def test_entropy_matches_direct_formula_across_chunks():
    torch.manual_seed(0)
    logits = 2 * torch.randn(3, 7, 40)
    p = logits.double().softmax(-1)
    direct = -(p * p.log()).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=4).double(), direct, rtol=0, atol=1e-5)
    # uniform distribution over V tokens: entropy log V
    assert entropy_from_logits(torch.zeros(1, 2, 40))[0].tolist() == pytest.approx([math.log(40)] * 2)


def test_config_validation():
    with pytest.raises(ValueError):
        LossConfig(loss_type="dr_grpo")  # needs max_completion_length
    with pytest.raises(ValueError):
        LossConfig(loss_type="ppo")
    with pytest.raises(ValueError):
        LossConfig(tis_cap=0.0)


def test_loss_config_takes_every_loss_field_from_the_grpo_settings():
    from qerl.config import GRPOSettings

    settings = GRPOSettings(loss_type="dr_grpo", epsilon_low=0.1, epsilon_high=0.3, beta=0.05, mask_truncated=True,
                            tis_cap=2.0)
    assert LossConfig.from_settings(settings, max_completion_length=24) == LossConfig(
        loss_type="dr_grpo", epsilon_low=0.1, epsilon_high=0.3, beta=0.05, max_completion_length=24,
        mask_truncated=True, tis_cap=2.0)
    assert LossConfig.from_settings(settings, 24).correction == "tis"  # the shorthand, as params files use it


# ----------------------------------------------------------------------------- the losses beside TRL's
# References written from each paper's formula, one sequence and one token at a time, on random tensors: the
# vectorised loss must equal them, on the whole batch and accumulated over micro-batches (as the trainer does).

def paper_loss(logp, old, adv, mask, loss_type, level="token", eps_low=0.2, eps_high=0.28, tau_pos=1.0,
               tau_neg=1.05, max_len=None, weights=None, kept=None):
    """The objective's negative, summed and normalised per `loss_type`; `weights`: the correction weight of each
    token (a [B, T] list), `kept`: the entropy mask (1/0 per token)."""
    B, T = logp.shape
    token_terms = []  # per sequence: its tokens' loss terms
    for i in range(B):
        tokens = [t for t in range(T) if mask[i, t]]
        a = float(adv[i])
        # GSPO (eq. 7): s_i = (pi / pi_old)^(1 / |y_i|) = exp(mean_t (logp - old)), one ratio for every token of y_i
        seq_ratio = torch.exp(sum(logp[i, t] - old[i, t] for t in tokens) / max(len(tokens), 1))
        terms = []
        for t in tokens:
            r = seq_ratio if level == "sequence" else torch.exp(logp[i, t] - old[i, t])
            if loss_type == "cispo":  # MiniMax-M1 eq. 4 (TRL/ScaleRL cap): sg(min(r, eps_max)) * A * log pi
                term = -min(r.detach(), torch.tensor(eps_high, dtype=r.dtype)) * a * logp[i, t]
            elif loss_type == "sapo":  # SAPO eq. 4: f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau by the sign of A
                tau = tau_pos if a > 0 else tau_neg
                term = -torch.sigmoid(tau * (r - 1)) * 4 / tau * a
            else:  # the PPO clip of GRPO / DAPO / Dr. GRPO / BNPO
                term = -torch.minimum(r * a, r.clamp(1 - eps_low, 1 + eps_high) * a)
            if weights is not None:
                term = term * weights[i][t]
            if kept is not None:
                term = term * kept[i][t]
            terms.append(term)
        token_terms.append(terms)
    total = sum(sum(terms) for terms in token_terms)
    tokens = sum(len(terms) for terms in token_terms)
    if loss_type in ("grpo", "sapo"):  # 1/G sum_i 1/|y_i| sum_t
        return sum(sum(terms) / max(len(terms), 1) for terms in token_terms) / B
    if loss_type == "dr_grpo":
        return total / (B * max_len)
    return total / tokens  # dapo, cispo (over the batch's tokens), bnpo (its micro-batch's: one here)


def random_batch(seed=0, B=6, T=7, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    # ratios from ~0.6 to ~1.6 per token: every clip side binds somewhere
    logp = (old + 0.5 * torch.randn(B, T, generator=g, dtype=dtype)).requires_grad_(True)
    adv = torch.randn(B, generator=g, dtype=dtype)
    lengths = torch.tensor([7, 1, 4, 2, 6, 5])[:B]  # unequal lengths: the aggregations differ
    mask = (torch.arange(T) < lengths[:, None]).long()
    rollout = old + 0.4 * torch.randn(B, T, generator=g, dtype=dtype)
    entropy = torch.rand(B, T, generator=g, dtype=dtype) * 3
    return logp, old, adv, mask, rollout, entropy


def accumulated(logp, old, adv, mask, cfg, micro, **extra):
    """The trainer's accumulation: per micro-batch, `token_normalizer` = the step's loss tokens where the type is
    normalised by them, else the micro-batch's mean weighted by its share of the rows; plus the micro-batch's
    slice of every [B, ...] extra."""
    B = len(logp)
    step_tokens = float(loss_mask(mask, cfg).sum())
    total = 0
    for s in micro:
        part_extra = {k: v[s] if isinstance(v, torch.Tensor) else v for k, v in extra.items()}
        loss, _ = policy_loss(logp[s], old[s], adv[s], mask[s], cfg, token_normalizer=step_tokens, **part_extra)
        total = total + (loss if cfg.normalized_by_step_tokens else loss * (s.stop - s.start) / B)
    return total


CASES = {  # name: (LossConfig keywords, paper_loss keywords)
    "grpo": ({"loss_type": "grpo"}, {}),
    "dapo": ({"loss_type": "dapo"}, {}),
    "dr_grpo": ({"loss_type": "dr_grpo", "max_completion_length": 9}, {"max_len": 9}),
    "cispo": ({"loss_type": "cispo", "epsilon_high": 1.3}, {"eps_high": 1.3}),  # a low cap: some weights bind
    "sapo": ({"loss_type": "sapo", "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05}, {}),
    "gspo": ({"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon_low": 0.1, "epsilon_high": 0.15},
             {"level": "sequence", "eps_low": 0.1, "eps_high": 0.15}),
    "gspo-dapo": ({"loss_type": "dapo", "importance_sampling_level": "sequence", "epsilon_low": 0.1,
                   "epsilon_high": 0.15}, {"level": "sequence", "eps_low": 0.1, "eps_high": 0.15}),
    "cispo-sequence": ({"loss_type": "cispo", "epsilon_high": 1.2, "importance_sampling_level": "sequence"},
                       {"eps_high": 1.2, "level": "sequence"}),
    "sapo-sequence": ({"loss_type": "sapo", "importance_sampling_level": "sequence"}, {"level": "sequence"}),
}


@pytest.mark.parametrize("case", CASES)
def test_each_loss_equals_its_papers_formula_whole_and_accumulated(case):
    cfg_kwargs, paper_kwargs = CASES[case]
    cfg = LossConfig(**cfg_kwargs)
    logp, old, adv, mask, _, _ = random_batch()
    reference = paper_loss(logp, old, adv, mask, cfg.loss_type, **paper_kwargs)
    (reference_grad,) = torch.autograd.grad(reference, logp)

    whole, _ = policy_loss(logp, old, adv, mask, cfg)
    (whole_grad,) = torch.autograd.grad(whole, logp)
    assert whole.item() == pytest.approx(reference.item(), abs=1e-12)
    torch.testing.assert_close(whole_grad, reference_grad, rtol=0, atol=1e-12)

    if cfg.loss_type == "bnpo":
        return
    # micro-batches of 2, 3 and 1 rows (unequal, cutting across nothing in particular) add up to the whole batch
    acc = accumulated(logp, old, adv, mask, cfg, [slice(0, 2), slice(2, 5), slice(5, 6)])
    (acc_grad,) = torch.autograd.grad(acc, logp)
    assert acc.item() == pytest.approx(reference.item(), abs=1e-12)
    torch.testing.assert_close(acc_grad, reference_grad, rtol=0, atol=1e-12)
    assert whole_grad.abs().sum() > 0 and whole_grad[~mask.bool()].abs().max() == 0


def test_bnpo_normalises_by_each_micro_batchs_tokens():
    """TRL's bnpo: each micro-batch's token mean, averaged over the (equal) micro-batches; one micro-batch is dapo."""
    logp, old, adv, mask, _, _ = random_batch()
    cfg = LossConfig(loss_type="bnpo")
    halves = [slice(0, 3), slice(3, 6)]
    reference = sum(paper_loss(logp[s], old[s], adv[s], mask[s], "bnpo") for s in halves) / 2
    acc = accumulated(logp, old, adv, mask, cfg, halves)
    assert acc.item() == pytest.approx(reference.item(), abs=1e-12)
    torch.testing.assert_close(torch.autograd.grad(acc, logp)[0], torch.autograd.grad(reference, logp)[0],
                               rtol=0, atol=1e-12)
    whole, _ = policy_loss(logp, old, adv, mask, cfg)
    dapo, _ = policy_loss(logp, old, adv, mask, LossConfig(loss_type="dapo"))
    assert whole.item() == dapo.item() != pytest.approx(acc.item())


def test_cispo_keeps_a_gradient_where_the_clip_would_cut_it():
    """The hand-computed fixture's clipped tokens (r = 1.5 with A > 0, r = 0.7 with A < 0): the PPO clip zeroes
    their gradient, CISPO's capped weight does not (d/dlogp = -min(r, cap) * A / tokens)."""
    logp, old, adv, mask = make_inputs(requires_grad=True)
    loss, m = policy_loss(logp, old, adv, mask, LossConfig(loss_type="cispo", epsilon_high=1.28))
    loss.backward()
    assert logp.grad[0, 0].item() == pytest.approx(-1.28 * 1 / 5)  # r = 1.5 capped at 1.28
    assert logp.grad[1, 1].item() == pytest.approx(-0.7 * -2 / 5)
    assert logp.grad[1, 2] == 0  # padding
    assert m["clip_ratio/high"] == pytest.approx(1 / 5) and m["clip_ratio/low"] == 0  # only r = 1.5 exceeds 1.28


def test_sapo_gate_is_the_plain_gradient_on_policy_and_fades_off_policy():
    """SAPO's d/dlogp = -4 s (1 - s) r A, s = sigmoid(tau (r - 1)): -A at r = 1 (as every loss on-policy), smaller
    far from it."""
    logp = torch.log(torch.tensor([[1.0, 3.0]], dtype=torch.float64)).requires_grad_(True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    loss, m = policy_loss(logp, old, torch.ones(1, dtype=torch.float64), torch.ones(1, 2),
                          LossConfig(loss_type="sapo"))
    loss.backward()
    s = 1 / (1 + math.exp(-2.0))  # tau = 1 (A > 0), r = 3
    assert logp.grad[0].tolist() == pytest.approx([-1 / 2, -4 * s * (1 - s) * 3 / 2])
    assert "clip_ratio/region" not in m


def test_gspo_ratio_is_the_length_normalised_sequence_ratio():
    """Row 0's token ratios 1.5, 0.5, 1.0 give s = (0.75)^(1/3) for all three tokens; the metric counts its tokens."""
    logp, old, adv, mask = make_inputs()
    cfg = LossConfig(loss_type="dapo", importance_sampling_level="sequence", epsilon_low=0.05, epsilon_high=0.05)
    loss, m = policy_loss(logp, old, adv, mask, cfg)
    s0, s1 = 0.75 ** (1 / 3), (1.1 * 0.7) ** (1 / 2)  # 0.909 (A > 0: unclipped), 0.877 (A < 0: clipped at 0.95)
    assert loss.item() == pytest.approx((3 * -s0 * 1 + 2 * -0.95 * -2) / 5)
    assert m["ratio/mean"] == pytest.approx((3 * s0 + 2 * s1) / 5)
    assert m["clip_ratio/low"] == pytest.approx(2 / 5) and m["clip_ratio/high"] == 0


@pytest.mark.parametrize("correction", ["tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_correction_equals_its_definition_whole_and_accumulated(correction, level):
    """TIS truncates exp(old - rollout) at the cap, MIS drops what is beyond it; per token, or the product over a
    sequence's tokens; no gradient through the weights."""
    logp, old, adv, mask, rollout, _ = random_batch(seed=1)
    cap = 1.4
    cfg = LossConfig(loss_type="dapo", correction=correction, correction_level=level, correction_cap=cap)
    weights, beyond = [], []
    for i in range(len(logp)):
        tokens = [t for t in range(logp.shape[1]) if mask[i, t]]
        if level == "sequence":
            w = math.prod(math.exp(old[i, t] - rollout[i, t]) for t in tokens)
            row = [w] * logp.shape[1]
        else:
            row = [math.exp(old[i, t] - rollout[i, t]) for t in range(logp.shape[1])]
        weights.append([min(w, cap) if correction == "tis" else (w if w <= cap else 0.0) for w in row])
        beyond.append(sum(row[t] > cap for t in tokens))
    reference = paper_loss(logp, old, adv, mask, "dapo", weights=weights)
    loss, m = policy_loss(logp, old, adv, mask, cfg, rollout_logp=rollout)
    assert loss.item() == pytest.approx(reference.item(), abs=1e-12)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(reference, logp)[0],
                               rtol=0, atol=1e-12)
    acc = accumulated(logp, old, adv, mask, cfg, [slice(0, 4), slice(4, 6)], rollout_logp=rollout)
    assert acc.item() == pytest.approx(reference.item(), abs=1e-12)
    name, cut = ("tis_weight", "truncated") if correction == "tis" else ("mis_weight", "masked")
    tokens = int(mask.sum())
    assert m[f"{name}/{cut}"] == pytest.approx(sum(beyond) / tokens) and 0 < sum(beyond) < tokens
    assert m[f"{name}/mean"] == pytest.approx(sum(weights[i][t] for i in range(len(logp))
                                                  for t in range(logp.shape[1]) if mask[i, t]) / tokens)


def test_mis_drops_the_tokens_beyond_the_cap_and_tis_shorthand_is_token_tis():
    """The TIS fixture's weights 3 and 0.5 at cap 2: MIS drops the first token's loss (it still counts in the
    normaliser, as TRL's), keeps the second's; `tis_cap` is token-level TIS at that cap."""
    logp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    rollout = torch.tensor([[-math.log(3), math.log(2)]], dtype=torch.float64)
    adv, mask = torch.ones(1, dtype=torch.float64), torch.ones(1, 2)
    loss, m = policy_loss(logp, old, adv, mask, LossConfig(correction="mis", correction_cap=2.0),
                          rollout_logp=rollout)
    assert loss.item() == pytest.approx(-0.5 / 2) and m["mis_weight/masked"] == 0.5
    shorthand = LossConfig(tis_cap=2.0)
    assert (shorthand.correction, shorthand.correction_level, shorthand.correction_cap) == ("tis", "token", 2.0)
    assert LossConfig(correction="tis").correction_cap == 2.0  # the default cap
    with pytest.raises(ValueError, match="tis_cap"):
        LossConfig(tis_cap=2.0, correction="mis")
    with pytest.raises(ValueError, match="tis_cap"):
        LossConfig(tis_cap=2.0, correction_cap=3.0)
    with pytest.raises(ValueError, match="rollout_logp"):
        policy_loss(logp, old, adv, mask, LossConfig(correction="mis"))


@pytest.mark.parametrize("quantile", [0.2, 0.5, 0.0])
def test_top_entropy_mask_keeps_the_batchs_top_quantile_whole_and_accumulated(quantile):
    """The 80/20 rule: only tokens at or above the batch's (1 - rho) entropy quantile keep their loss; every loss
    token still counts in the normaliser. Micro-batches given the whole batch's threshold add up to the batch."""
    logp, old, adv, mask, _, entropy = random_batch(seed=2)
    cfg = LossConfig(loss_type="dapo", top_entropy_quantile=quantile)
    values = sorted(entropy[mask.bool()].tolist())
    position = (1 - quantile) * (len(values) - 1)  # the linearly interpolated quantile, as numpy's default
    below = values[math.floor(position)]
    cut = below + (values[math.ceil(position)] - below) * (position - math.floor(position))
    kept = (entropy >= cut).long().tolist()
    reference = paper_loss(logp, old, adv, mask, "dapo", kept=kept)
    loss, m = policy_loss(logp, old, adv, mask, cfg, entropy=entropy)
    assert loss.item() == pytest.approx(reference.item(), abs=1e-12)
    assert m["entropy_mask/kept"] == pytest.approx(sum(v >= cut for v in values) / len(values))
    threshold = entropy_threshold(entropy[mask.bool()], quantile)
    assert threshold == pytest.approx(cut, abs=1e-12)
    acc = accumulated(logp, old, adv, mask, cfg, [slice(0, 2), slice(2, 6)], entropy=entropy, entropy_cut=threshold)
    assert acc.item() == pytest.approx(reference.item(), abs=1e-12)
    torch.testing.assert_close(torch.autograd.grad(acc, logp)[0], torch.autograd.grad(reference, logp)[0],
                               rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(logp, old, adv, mask, cfg)


def test_a_tie_at_the_entropy_cut_is_not_split_by_an_ulp():
    """Rows of a group share their prompt: their first tokens' entropies are one value, computed in micro-batches of
    other shapes an ulp apart. Whichever copy the cut lands on, the tie is kept whole (or dropped whole)."""
    tie = torch.tensor(3.0466168)
    nudged = torch.nextafter(tie, torch.tensor(math.inf))
    entropies = torch.stack([torch.tensor(1.0), tie, nudged, torch.tensor(5.0)])
    for cut in (float(tie), float(nudged)):
        assert at_or_above(entropies, cut).tolist() == [False, True, True, True]
    assert not at_or_above(entropies, math.inf).any()  # no loss tokens: none kept
    assert at_or_above(entropies, 3.1).tolist() == [False, False, False, True]  # a real gap still cuts
