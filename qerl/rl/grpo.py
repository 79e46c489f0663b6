"""GRPO / DAPO / Dr. GRPO / BNPO / CISPO / SAPO / GSPO policy losses as pure functions over tensors.

Semantics follow TRL's ``GRPOTrainer`` (``_generate_and_score_completions`` for advantages and the
rollout importance-sampling correction, ``_compute_loss`` for the surrogates, the k3 KL, the loss
aggregations and the top-entropy mask), DAPO (arXiv 2503.14476: decoupled clip range, token-level
aggregation, dynamic sampling), Dr. GRPO (arXiv 2503.20783: no std scaling, constant length
normaliser), CISPO (MiniMax-M1, arXiv 2506.13585: clipped, detached importance weights on a
REINFORCE term), SAPO (arXiv 2511.20347: a sigmoid gate instead of the hard clip), GSPO (arXiv
2507.18071: one length-normalised ratio per sequence), TIS / MIS (Yao et al. 2025; Liu et al. 2025:
truncated or masked rollout-to-trainer weights) and the 80/20 rule (arXiv 2506.01939: the loss on the
highest-entropy tokens only).

Shapes: ``B`` sequences of ``T`` completion tokens, vocabulary ``V``; rewards are laid out
group-major (``G`` consecutive completions of the same prompt).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

import torch
from torch import Tensor

from qerl.execution import execution_of, training_ops
from qerl.execution.shared_prompts import forward_shared_prompts
from qerl.model.transformer import Decoder

LossType = Literal["grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo"]
Level = Literal["token", "sequence"]
Correction = Literal["none", "tis", "mis"]
DEFAULT_CORRECTION_CAP = 2.0  # C of TIS (Yao et al.) and of verl's rollout_is_threshold


# ----------------------------------------------------------------------------- advantages


def group_advantages(
    rewards: Tensor,
    group_size: int,
    scale: Literal["group", "batch", "none"] = "group",
    eps: float = 1e-4,
) -> Tensor:
    """Group-relative advantages ``r - mean(group)``, optionally divided by a std.

    ``scale="group"``: divide by the group's std (GRPO); ``"batch"``: by the std of the whole
    batch (TRL's ``scale_rewards="batch"``); ``"none"``: no division (Dr. GRPO, which removes the
    question-difficulty bias the std introduces). The std is Bessel-corrected and ``eps`` is added
    to it, exactly as TRL does, so an all-equal group gets advantage 0, never NaN.

    Args:
        rewards: ``[B*G]`` rewards, ``G = group_size`` consecutive entries per prompt.
    Returns:
        ``[B*G]`` float32 advantages.
    """
    if rewards.ndim != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a length divisible by group_size={group_size}")
    rewards = rewards.float()
    grouped = rewards.view(-1, group_size)
    centered = (grouped - grouped.mean(dim=1, keepdim=True)).flatten()
    if scale == "none":
        return centered
    if scale == "group":
        std = grouped.std(dim=1, correction=int(group_size > 1)).repeat_interleave(group_size)
    elif scale == "batch":
        std = rewards.std(correction=int(rewards.numel() > 1)).expand_as(centered)
    else:
        raise ValueError(f"unknown scale {scale!r}; expected 'group', 'batch' or 'none'")
    return centered / (std + eps)


def informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """``[B]`` bool: False where every reward of the group is equal.

    Such groups have zero advantage and contribute no policy gradient; DAPO's dynamic sampling
    drops them and keeps sampling until the batch is full of informative groups.
    """
    if rewards.ndim != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a length divisible by group_size={group_size}")
    grouped = rewards.view(-1, group_size)
    return (grouped != grouped[:, :1]).any(dim=1)


# ----------------------------------------------------------------------------- log-probs


class _SelectiveLogSoftmax(torch.autograd.Function):
    """log_softmax(logits)[ids] without materialising a [B, T, V] log-softmax.

    Forward upcasts one batch row at a time to compute its logsumexp. Backward recomputes the
    softmax row by row from the saved logits (which the caller holds anyway) and the [B, T]
    logsumexp, so nothing vocabulary-sized is saved beyond the logits themselves.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, ids: Tensor) -> Tensor:
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        lse = torch.stack([torch.logsumexp(row.to(compute_dtype), dim=-1) for row in logits])
        picked = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1).to(compute_dtype)
        ctx.save_for_backward(logits, ids, lse)
        return picked - lse

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None]:
        logits, ids, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for b in range(logits.shape[0]):
            # d logp_t / d logits_tv = 1[v == id_t] - softmax(logits_t)_v
            softmax = (logits[b].to(lse.dtype) - lse[b].unsqueeze(-1)).exp_()
            row = softmax.mul_(-grad_out[b].unsqueeze(-1))
            row.scatter_add_(-1, ids[b].unsqueeze(-1), grad_out[b].unsqueeze(-1).to(row.dtype))
            grad[b] = row
        return grad, None


def selective_log_softmax(logits: Tensor, ids: Tensor) -> Tensor:
    """Log-probability of ``ids`` under ``logits``: ``log_softmax(logits, -1).gather(-1, ids)``.

    Exact (computed in at least float32 even for bf16 logits, unlike a bf16 log_softmax) and
    memory-frugal: peak extra memory is one ``[T, V]`` float32 row, in forward and backward.

    Args:
        logits: ``[B, T, V]`` (already divided by the sampling temperature).
        ids: ``[B, T]`` token ids.
    Returns:
        ``[B, T]`` log-probs in float32 (float64 for float64 logits).
    """
    return _SelectiveLogSoftmax.apply(logits, ids)


class _HeadLogProbs(torch.autograd.Function):
    """log_softmax(linear(hidden, weight) / temperature)[ids], computed ``chunk_size`` tokens at a time.

    The [B, T, V] logits never exist. Where only ``hidden`` needs a gradient (a frozen head: the trainer's case),
    forward also takes each token's derivative d logp_t / d hidden_t = (W[id_t] - softmax_t @ W) / temperature, an
    [H] vector (logp_t depends on hidden_t alone), so backward is one scale of those by the upstream gradient: the
    head's logits are computed once per update, not again in backward. Where ``weight`` needs one too, forward keeps
    only the [N] logsumexps and backward recomputes each chunk's logits from the saved hidden states. Where the
    fused training kernels run (`TrainingOps.head_kernel`: CUDA) one kernel takes each chunk's log-sum-exp,
    log-probs, entropies and softmax from the logits in the head's dtype, in chunks of up to its CHUNK_BYTES;
    elsewhere PyTorch does, a ``[128, V]`` float32 block at a time.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, ids: Tensor, temperature: float, chunk_size: int | None,
                want_entropy: bool, ops: training_ops.TrainingOps) -> tuple[Tensor, Tensor]:
        flat_hidden, flat_ids = hidden.reshape(-1, hidden.shape[-1]), ids.reshape(-1)
        # Only hidden needs a gradient: its per-token derivative now, from the chunk's softmax at hand.
        per_token = ctx.needs_input_grad[0] and not ctx.needs_input_grad[1]
        logps, lses, entropies, derivatives = [], [], [], []
        rows = ops.head_kernel(weight)
        if rows is not None:  # CUDA: one kernel reduces each chunk's logits, in chunks sized for the head's GEMMs
            chunk = chunk_size or rows.chunk_rows(weight.shape[0], weight.element_size())
            for h, i in zip(flat_hidden.split(chunk), flat_ids.split(chunk)):
                logits = torch.nn.functional.linear(h, weight)  # in the model dtype, as nn.Linear gives them
                logp, lse, entropy = rows.row_stats(logits, i, temperature, want_entropy, probs_in_place=per_token)
                logps.append(logp)
                lses.append(lse)
                entropies.append(entropy)
                if per_token:  # `logits` now holds the softmax in the head's dtype: its GEMM on the tensor cores
                    expected = (logits @ weight).float()
                    derivatives.append(weight[i].float().sub_(expected).div_(temperature))
        else:
            chunk = chunk_size or 128
            for h, i in zip(flat_hidden.split(chunk), flat_ids.split(chunk)):
                logits = _tempered_logits(h, weight, temperature)
                lse = torch.logsumexp(logits, dim=-1)
                logps.append(logits.gather(-1, i.unsqueeze(-1)).squeeze(-1) - lse)
                lses.append(lse)
                if want_entropy or per_token:
                    logp_all = logits.sub_(lse.unsqueeze(-1))  # in place: the chunk's logits are not needed again
                    probs = logp_all.exp()
                    if want_entropy:
                        entropies.append(-(probs * logp_all).sum(dim=-1))
                    if per_token:  # the head's GEMM in its dtype, as nn.Linear's backward (bf16 tensor cores)
                        expected = (probs.to(weight.dtype) @ weight).to(lse.dtype)
                        derivatives.append(weight[i].to(lse.dtype).sub_(expected).div_(temperature))
        if per_token:
            ctx.save_for_backward(torch.cat(derivatives))
        else:
            ctx.save_for_backward(hidden, weight, ids, torch.cat(lses))
        ctx.per_token, ctx.hidden_shape, ctx.hidden_dtype = per_token, hidden.shape, hidden.dtype
        ctx.temperature, ctx.chunk_size = temperature, chunk_size or 128  # backward's chunks are float32
        entropy = torch.cat(entropies).view(ids.shape) if want_entropy else torch.empty(0)
        ctx.mark_non_differentiable(entropy)
        return torch.cat(logps).view(ids.shape), entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, _grad_entropy: Tensor | None):
        if ctx.per_token:
            (derivatives,) = ctx.saved_tensors
            grad_hidden = derivatives * grad_logp.reshape(-1, 1).to(derivatives.dtype)
            return grad_hidden.to(ctx.hidden_dtype).view(ctx.hidden_shape), None, None, None, None, None, None
        hidden, weight, ids, lse = ctx.saved_tensors
        flat_hidden, flat_ids = hidden.reshape(-1, hidden.shape[-1]), ids.reshape(-1)
        grad_out = grad_logp.reshape(-1)
        grad_hidden = torch.empty_like(flat_hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=lse.dtype) if ctx.needs_input_grad[1] else None
        start = 0
        for h, i in zip(flat_hidden.split(ctx.chunk_size), flat_ids.split(ctx.chunk_size)):
            rows = slice(start, start + len(h))
            g = grad_out[rows].to(lse.dtype).unsqueeze(-1)
            # d logp_t / d logits_tv = (1[v == id_t] - softmax_tv) / temperature
            grad_logits = _tempered_logits(h, weight, ctx.temperature).sub_(lse[rows].unsqueeze(-1)).exp_().mul_(-g)
            grad_logits.scatter_add_(-1, i.unsqueeze(-1), g).div_(ctx.temperature)
            if grad_hidden is not None:  # in the head's dtype, as nn.Linear's backward after a plain `.float()`
                # of its logits: bf16 tensor cores on the GPU. (In float32 this GEMM and a float32 copy of the
                # [V, H] weight per chunk were ~1.6 s of a 7B GRPO update's 13.5.)
                grad_hidden[rows] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.T, h.to(lse.dtype))
            start += len(h)
        return (None if grad_hidden is None else grad_hidden.view(hidden.shape),
                None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None, None)


def _tempered_logits(hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    """A chunk's logits in at least float32, divided by the temperature: the head's GEMM runs in the model dtype,
    as `nn.Linear` does, so bf16 models get the same rounded logits as a plain forward."""
    logits = torch.nn.functional.linear(hidden, weight)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits if temperature == 1.0 else logits.div_(temperature)


def head_log_probs(hidden: Tensor, weight: Tensor, ids: Tensor, temperature: float = 1.0,
                   want_entropy: bool = False, chunk_size: int | None = None,
                   ops: training_ops.TrainingOps = training_ops.EAGER) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities of ``ids`` (and the per-token entropies) under the LM head ``weight`` at ``temperature``.

    Equals ``selective_log_softmax(linear(hidden, weight).float() / temperature, ids)`` (and
    ``entropy_from_logits`` of the same logits) without materialising the ``[B, T, V]`` logits, in forward or
    backward: the biggest full-vocabulary temporary is one chunk of tokens' logits.

    Args:
        hidden: ``[B, T, H]`` final hidden states at the positions that predict ``ids``.
        weight: ``[V, H]`` LM head weight (no bias).
        ids: ``[B, T]`` token ids.
        chunk_size: tokens per chunk; None: `qerl.kernels.vocab_softmax.chunk_rows` where its kernel runs, else 128.
        ops: the model's training ops (`qerl.execution`): where they are fused, the head's kernel runs.
    Returns:
        ``([B, T] float32 log-probs, [B, T] float32 entropies or None)``; the entropies carry no gradient.
    """
    logp, entropy = _HeadLogProbs.apply(hidden, weight, ids, float(temperature), chunk_size, want_entropy, ops)
    return logp, entropy if want_entropy else None


def entropy_from_logits(logits: Tensor, chunk_size: int = 128) -> Tensor:
    """Per-token entropy ``-sum_v p_v log p_v`` of ``softmax(logits)``.

    Processes ``chunk_size`` token positions at a time so the float32 softmax temporaries stay
    ``[chunk_size, V]`` instead of ``[B, T, V]``. Meant for logging, typically under no_grad.

    Returns:
        ``logits.shape[:-1]`` float32 entropies.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    chunks = []
    for chunk in flat.split(chunk_size):
        logp = chunk.float().log_softmax(dim=-1)
        chunks.append(-(logp.exp() * logp).sum(dim=-1))
    return torch.cat(chunks).view(logits.shape[:-1])


def completion_log_probs(model, ids: Tensor, attn: Tensor, P: int, temperature: float, share_prompts: bool,
                         want_entropy: bool, pack: bool = False) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs (and entropies) of the completion tokens ``ids[:, P:]`` under ``model`` (a
    ``qerl.model.transformer.Transformer``) at the sampling ``temperature``: the update's forward.

    Only the positions that predict completion tokens go through the LM head, and ``head_log_probs`` runs it a chunk
    of tokens at a time: the ``[B, C, V]`` float32 logits (and their gradient) are never built. With
    ``share_prompts`` the rows that repeat a prompt run it through the blocks once (``forward_shared_prompts``). With
    ``pack`` only the real tokens (``attn`` 1) go through the blocks' GEMMs and the head, and the padding positions'
    log-probs and entropies are 0 (the loss masks them).
    """
    C = ids.shape[1] - P
    predicting = torch.arange(P - 1, P + C - 1, device=ids.device)
    decoder = model.model
    if (share_prompts or pack) and isinstance(decoder, Decoder):
        hidden = forward_shared_prompts(decoder, ids, attn, P, share=share_prompts, pack=pack)[:, predicting]
    else:
        hidden = decoder(ids, attention_mask=attn)[:, predicting]
    targets = ids[:, P:]
    real = attn[:, P:].bool() if pack else None
    if real is not None:  # one row of the real tokens: the head's chunks hold no padding
        hidden, targets = hidden[real][None], targets[real][None]
    logp, entropy = _head_log_probs(model, hidden, targets, temperature, want_entropy)
    if real is not None:
        logp = logp.new_zeros(real.shape).index_put((real,), logp[0])
        entropy = None if entropy is None else entropy.new_zeros(real.shape).index_put((real,), entropy[0])
    return logp, entropy


def _head_log_probs(model, hidden: Tensor, targets: Tensor, temperature: float,
                    want_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """`completion_log_probs`' LM head on the hidden states that predict `targets`."""
    head = model.lm_head
    if type(head) is torch.nn.Linear and head.bias is None and model.config.final_logit_softcapping is None:
        return head_log_probs(hidden, head.weight, targets, temperature, want_entropy=want_entropy,
                              ops=execution_of(model).ops)
    # A head that is not a plain linear (LoRA named lm_head), or logits softcapped as the sampler's are (Gemma's
    # final_logit_softcapping): its logits, once, in float32.
    logits = model.softcap(head(hidden).float()).div_(temperature)
    entropy = entropy_from_logits(logits.detach()) if want_entropy else None
    return selective_log_softmax(logits, targets), entropy


# ----------------------------------------------------------------------------- loss


@dataclass
class LossConfig:
    """Policy-loss hyperparameters (the params file's `grpo` keys of the same names; README "The policy losses").

    Attributes:
        loss_type: the surrogate and its aggregation. ``"grpo"`` clipped ratio, mean over each
            sequence's tokens, then over sequences; ``"dapo"`` clipped ratio, sum over all tokens /
            tokens in the whole (accumulated) batch (no length bias between sequences);
            ``"dr_grpo"`` clipped ratio, sum / (B * max_completion_length); ``"bnpo"`` clipped
            ratio, sum / tokens of the micro-batch (TRL's: with one micro-batch it is ``"dapo"``);
            ``"cispo"`` ``-sg(min(ratio, epsilon_high)) * A * logp``, aggregated as ``"dapo"``:
            every token keeps a gradient, the clip only bounds its weight; ``"sapo"``
            ``-sigmoid(tau * (ratio - 1)) * 4 / tau * A`` (tau by the advantage's sign), aggregated
            as ``"grpo"``: a smooth gate that fades off-policy tokens out instead of cutting them.
        epsilon_low, epsilon_high: ratio clip range ``[1 - epsilon_low, 1 + epsilon_high]``
            (DAPO's clip-higher: a larger upper bound keeps low-probability tokens rising,
            which delays entropy collapse). ``"cispo"``: ``epsilon_high`` is the weight's cap
            itself (TRL's and ScaleRL's ``epsilon_max``, e.g. 5), ``epsilon_low`` is unused.
        beta: weight of the k3 KL to the reference policy; 0 disables it (DAPO).
        max_completion_length: the constant normaliser of ``"dr_grpo"``.
        mask_truncated: drop sequences that hit the length limit (DAPO overlong filtering):
            their missing ending makes the reward noise.
        importance_sampling_level: ``"token"`` one ratio per token; ``"sequence"`` GSPO's one
            ratio per sequence, ``exp(mean over its tokens of (logp - old_logp))``.
        sapo_temperature_pos, sapo_temperature_neg: SAPO's gate temperatures for tokens of
            positive and of non-positive advantage.
        correction: the rollout-to-trainer correction, a weight ``exp(old_logp - rollout_logp)``
            per token (``correction_level="token"``) or its product per sequence (``"sequence"``);
            ``"tis"`` truncates it at ``correction_cap``, ``"mis"`` zeroes it beyond the cap
            (the token's or sequence's loss is dropped), ``"none"`` applies none.
        correction_cap: the cap ``C``; None: ``tis_cap`` if set, else ``DEFAULT_CORRECTION_CAP``.
        tis_cap: shorthand kept from before ``correction``: ``tis_cap=C`` is ``correction="tis"``
            with ``correction_cap=C`` (at ``correction_level``, token by default).
        top_entropy_quantile: keep in the loss only the tokens whose entropy is in this top
            quantile of the batch's loss tokens (1.0: all; the 80/20 paper's 0.2).
    """

    loss_type: LossType = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    beta: float = 0.0
    max_completion_length: int | None = None
    mask_truncated: bool = False
    importance_sampling_level: Level = "token"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    correction: Correction = "none"
    correction_level: Level = "token"
    correction_cap: float | None = None
    tis_cap: float | None = None
    top_entropy_quantile: float = 1.0

    @classmethod
    def from_settings(cls, settings: object, max_completion_length: int | None) -> "LossConfig":
        """The loss fields of a settings object (the params file's `grpo` section: same names), plus the one value
        that lives elsewhere (`rollout.max_new_tokens`). Duck-typed, so this module stays free of the config.
        correction "auto" is the trainer's to resolve (it knows the sampler's precision); unresolved, it is none."""
        names = [f.name for f in fields(cls) if f.name != "max_completion_length"]
        values = {n: getattr(settings, n) for n in names}
        if values.get("correction") == "auto":
            values["correction"] = "none"
        return cls(max_completion_length=max_completion_length, **values)

    def __post_init__(self) -> None:
        if self.loss_type not in ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo"):
            raise ValueError(f"unknown loss_type {self.loss_type!r}")
        if self.loss_type == "dr_grpo" and not self.max_completion_length:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        if not (0 <= self.epsilon_low < 1 and self.epsilon_high >= 0 and self.beta >= 0):
            raise ValueError("need 0 <= epsilon_low < 1, epsilon_high >= 0, beta >= 0")
        if self.loss_type == "cispo" and self.epsilon_high <= 1:
            raise ValueError(f"loss_type='cispo' caps the importance weight at epsilon_high itself (e.g. 5.0); "
                             f"epsilon_high={self.epsilon_high} <= 1 would down-weight every on-policy token")
        if min(self.sapo_temperature_pos, self.sapo_temperature_neg) <= 0:
            raise ValueError("the SAPO temperatures must be positive")
        if self.importance_sampling_level not in ("token", "sequence") or \
                self.correction_level not in ("token", "sequence"):
            raise ValueError("importance_sampling_level and correction_level: 'token' or 'sequence'")
        if self.correction not in ("none", "tis", "mis"):
            raise ValueError(f"unknown correction {self.correction!r}; expected 'none', 'tis' or 'mis'")
        if any(c is not None and c <= 0 for c in (self.tis_cap, self.correction_cap)):
            raise ValueError("tis_cap and correction_cap must be positive")
        if self.tis_cap is not None:  # the shorthand: correction tis at this cap
            if self.correction == "mis" or self.correction_cap not in (None, self.tis_cap):
                raise ValueError(f"tis_cap={self.tis_cap} means correction='tis' with correction_cap={self.tis_cap}; "
                                 f"it contradicts correction={self.correction!r}, "
                                 f"correction_cap={self.correction_cap}: set one or the other")
            self.correction, self.correction_cap = "tis", self.tis_cap
        if self.correction_cap is None:
            self.correction_cap = DEFAULT_CORRECTION_CAP
        if not 0 <= self.top_entropy_quantile <= 1:
            raise ValueError("top_entropy_quantile must lie in [0, 1]")

    @property
    def normalized_by_step_tokens(self) -> bool:
        """The loss divides by the loss tokens of the whole accumulated step (``token_normalizer``), so micro-batch
        losses add up to the step's; the other types are per-micro-batch means, weighted by the micro-batch's share
        of the rows."""
        return self.loss_type in ("dapo", "cispo")


def loss_mask(mask: Tensor, cfg: LossConfig, truncated: Tensor | None = None) -> Tensor:
    """The float token mask the loss uses: ``mask``, with truncated sequences zeroed when
    ``cfg.mask_truncated``. Sum it over all micro-batches to get ``token_normalizer``."""
    mask = mask.float()
    if cfg.mask_truncated:
        if truncated is None:
            raise ValueError("cfg.mask_truncated needs the `truncated` [B] flags")
        mask = mask * (~truncated.bool()).unsqueeze(1).to(mask.dtype)
    return mask


ENTROPY_TIE = 1e-5  # relative: far above float32's ulp-level batch-shape noise, far below real entropy gaps


def entropy_threshold(entropies: Tensor, quantile: float) -> float:
    """The entropy at or above which a token is in the top ``quantile`` of ``entropies`` (the 1-D entropies of a
    whole batch's loss tokens): their ``1 - quantile`` quantile, linearly interpolated (TRL's
    ``get_high_entropy_mask``). inf for no tokens: then none is kept."""
    if not entropies.numel():
        return math.inf
    return torch.quantile(entropies.to(torch.promote_types(entropies.dtype, torch.float32)), 1 - quantile).item()


def at_or_above(entropy: Tensor, cut: float) -> Tensor:
    """The tokens whose entropy is at or above `cut` (an `entropy_threshold`), ties within ENTROPY_TIE of it counted
    as at it: rows of a group share their prompt, so their first tokens' entropies are one value and the quantile
    often lands on such a tie; the same value computed in micro-batches of other shapes differs by an ulp or two,
    which must not split the tie (the kept tokens would depend on grpo.micro_batch_size)."""
    if not math.isfinite(cut):
        return torch.zeros_like(entropy, dtype=torch.bool)
    return entropy >= cut - ENTROPY_TIE * abs(cut)


def rollout_correction(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor,
                       cfg: LossConfig) -> tuple[Tensor, Tensor]:
    """The rollout-to-trainer correction weights (``cfg.correction``: tis or mis) and where the ratio exceeded the
    cap, both ``[B, T]`` (``correction_level="token"``) or ``[B, 1]`` (``"sequence"``). The ratio is
    ``exp(old_logp - rollout_logp)``: the trainer's probability of the sampled token over the sampler's (quantized
    kernels, AQN); per sequence it is the product over its loss tokens, as TRL and verl take it. The weights carry no
    gradient (a constant reweighting of each token's)."""
    log_ratio = torch.where(mask.bool(), old_logp - rollout_logp, 0.0)  # padding may hold -inf: keep it out
    if cfg.correction_level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True)
    ratio = torch.exp(log_ratio).detach()
    beyond = ratio > cfg.correction_cap
    weight = ratio.clamp(max=cfg.correction_cap) if cfg.correction == "tis" else torch.where(beyond, 0.0, ratio)
    return weight, beyond


def policy_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    ref_logp: Tensor | None = None,
    rollout_logp: Tensor | None = None,
    truncated: Tensor | None = None,
    token_normalizer: float | None = None,
    entropy: Tensor | None = None,
    entropy_cut: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Policy loss of one (micro-)batch, plus metrics.

    Per token, with ``ratio = exp(logp - old_logp)`` (``cfg.importance_sampling_level="sequence"``: GSPO's
    ``exp(mean_t(logp - old_logp))``, one per sequence): the clipped surrogate ``-min(ratio * A, clip(ratio) * A)``,
    or CISPO's / SAPO's (see `LossConfig`); times the rollout correction weight (`rollout_correction`) when
    ``cfg.correction`` is set (corrects for the rollout engine sampling from a slightly different distribution than
    the trainer computes: quantized kernels, AQN); times 0 for tokens below the batch's top-entropy quantile when
    ``cfg.top_entropy_quantile < 1``; plus ``beta * (exp(ref - logp) - (ref - logp) - 1)`` (the k3 KL estimator:
    unbiased, always >= 0) when ``cfg.beta > 0`` and ``ref_logp`` is given. Then aggregated per ``cfg.loss_type``;
    a token dropped by MIS or the entropy mask still counts in the normaliser (TRL, and the 80/20 paper's formula).

    Gradient accumulation: where ``cfg.normalized_by_step_tokens`` (dapo, cispo) pass ``token_normalizer`` = the
    loss-token count of the whole accumulated batch (sum of :func:`loss_mask`), and the micro-batch losses sum to
    the big-batch loss exactly. The other types return per-micro-batch means: weight each by its share of the rows
    (equal micro-batches: divide by their number, as TRL does). With the entropy mask, pass ``entropy_cut`` =
    :func:`entropy_threshold` of the whole batch's loss tokens, so every micro-batch keeps the same tokens.

    Args:
        logp: ``[B, T]`` log-probs of the policy being trained (with grad).
        old_logp: ``[B, T]`` log-probs of the policy that produced the samples, computed by the
            trainer; None means on-policy (``logp.detach()``, ratio 1 with the right gradient).
        advantages: ``[B]`` per-sequence (or ``[B, T]`` per-token) advantages.
        mask: ``[B, T]`` 1 for completion tokens, 0 for padding.
        ref_logp: ``[B, T]`` reference-policy log-probs, for the KL term.
        rollout_logp: ``[B, T]`` log-probs reported by the rollout engine, for the correction and
            the rollout/train gap metrics.
        truncated: ``[B]`` bool, True where the completion hit the length limit.
        entropy: ``[B, T]`` per-token entropies, for ``cfg.top_entropy_quantile < 1``.
        entropy_cut: the entropy threshold of the whole batch; None: this batch's.
    Returns:
        ``(loss, metrics)``: scalar loss; float metrics over the loss tokens:
        ``clip_ratio/low`` (ratio < 1-eps_low with A < 0), ``clip_ratio/high`` (ratio > 1+eps_high
        with A > 0; cispo: ratio > epsilon_high, the cap), ``clip_ratio/region`` (either; none for sapo, which does
        not clip), ``ratio/mean``, ``kl`` (if computed), ``rollout_logp_gap/mean`` and ``/max``
        (|old_logp - rollout_logp|, if rollout_logp), ``tis_weight/mean`` and ``tis_weight/truncated`` (the share of
        tokens whose weight, or their sequence's, was cut to the cap) or ``mis_weight/mean`` and
        ``mis_weight/masked`` (the share dropped), ``entropy_mask/kept`` (the share kept by the entropy mask).
    """
    old_logp = logp.detach() if old_logp is None else old_logp
    mask = loss_mask(mask, cfg, truncated).to(logp.dtype)
    keep = mask.bool()
    adv = advantages.unsqueeze(1) if advantages.ndim == 1 else advantages
    adv = adv.to(logp.dtype)

    # where(), not a product: a NaN/inf at a padding position (e.g. rollout_logp padding) must not leak.
    log_ratio = torch.where(keep, logp - old_logp, 0.0)
    if cfg.importance_sampling_level == "sequence":  # GSPO: [B, 1], the length-normalised sequence ratio
        log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    ratio = torch.exp(log_ratio)
    if cfg.loss_type == "cispo":  # REINFORCE on logp, weighted by the capped ratio: no token loses its gradient
        per_token = -ratio.clamp(max=cfg.epsilon_high).detach() * adv * logp
    elif cfg.loss_type == "sapo":  # d/dlogp = 4 s(1-s) * ratio, s = sigmoid(tau (ratio - 1)): 1 on-policy
        tau = torch.full_like(adv, cfg.sapo_temperature_neg).masked_fill_(adv > 0, cfg.sapo_temperature_pos)
        per_token = -torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * adv
    else:
        clipped_ratio = ratio.clamp(1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
        per_token = -torch.min(ratio * adv, clipped_ratio * adv)

    correction = None
    if cfg.correction != "none":
        if rollout_logp is None:
            raise ValueError(f"correction={cfg.correction!r} needs rollout_logp")
        correction = rollout_correction(old_logp, rollout_logp, mask, cfg)
        per_token = per_token * correction[0]

    kept_by_entropy = None
    if cfg.top_entropy_quantile < 1:
        if entropy is None:
            raise ValueError("top_entropy_quantile < 1 needs the per-token entropy")
        cut = entropy_threshold(entropy[keep], cfg.top_entropy_quantile) if entropy_cut is None else entropy_cut
        kept_by_entropy = at_or_above(entropy, cut)
        per_token = per_token * kept_by_entropy

    per_token_kl = None
    if cfg.beta > 0 and ref_logp is not None:
        delta = ref_logp - logp
        per_token_kl = torch.exp(delta) - delta - 1
        per_token = per_token + cfg.beta * per_token_kl

    per_token = torch.where(keep, per_token, 0.0)  # [B, T] also where the ratio is one per sequence
    masked_sum = per_token.sum()
    if cfg.loss_type in ("grpo", "sapo"):
        loss = (per_token.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif cfg.loss_type == "bnpo":
        loss = masked_sum / mask.sum().clamp(min=1.0)
    elif cfg.normalized_by_step_tokens:  # dapo, cispo
        denominator = token_normalizer if token_normalizer is not None else mask.sum().clamp(min=1.0)
        loss = masked_sum / denominator
    else:  # dr_grpo: a constant denominator, so long and short answers weigh the same per token
        loss = masked_sum / (logp.shape[0] * cfg.max_completion_length)

    metrics = _metrics(ratio.expand_as(logp), adv, mask, cfg, per_token_kl, old_logp, rollout_logp, correction,
                       kept_by_entropy)
    return loss, metrics


@torch.no_grad()
def _metrics(
    ratio: Tensor,
    adv: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    per_token_kl: Tensor | None,
    old_logp: Tensor,
    rollout_logp: Tensor | None,
    correction: tuple[Tensor, Tensor] | None,
    kept_by_entropy: Tensor | None,
) -> dict[str, float]:
    """Masked token means of the loss's diagnostics (TRL's clip-ratio definitions)."""
    keep = mask.bool()
    count = keep.sum().clamp(min=1)

    def masked_mean(x: Tensor) -> float:
        return (torch.where(keep, x.to(mask.dtype), 0.0).sum() / count).item()

    metrics = {}
    if cfg.loss_type == "cispo":  # the cap binds whatever the advantage's sign; there is no lower bound
        high = ratio > cfg.epsilon_high
        metrics.update({"clip_ratio/low": 0.0, "clip_ratio/high": masked_mean(high),
                        "clip_ratio/region": masked_mean(high)})
    elif cfg.loss_type != "sapo":
        # Clipping only bites when it lowers the objective: high side for A > 0, low side for A < 0.
        low = (ratio < 1 - cfg.epsilon_low) & (adv < 0)
        high = (ratio > 1 + cfg.epsilon_high) & (adv > 0)
        metrics.update({"clip_ratio/low": masked_mean(low), "clip_ratio/high": masked_mean(high),
                        "clip_ratio/region": masked_mean(low | high)})
    metrics["ratio/mean"] = masked_mean(ratio)
    if per_token_kl is not None:
        metrics["kl"] = masked_mean(per_token_kl)
    if rollout_logp is not None:
        gap = (old_logp - rollout_logp).abs()
        metrics["rollout_logp_gap/mean"] = masked_mean(gap)
        metrics["rollout_logp_gap/max"] = gap[keep].max().item() if keep.any() else 0.0
    if correction is not None:
        weight, beyond = (x.expand_as(mask) for x in correction)
        name, cut = ("tis_weight", "truncated") if cfg.correction == "tis" else ("mis_weight", "masked")
        metrics[f"{name}/mean"] = masked_mean(weight)
        metrics[f"{name}/{cut}"] = masked_mean(beyond)
    if kept_by_entropy is not None:
        metrics["entropy_mask/kept"] = masked_mean(kept_by_entropy)
    return metrics
