"""Verifying drafted tokens: the rejection rule that makes a speculative rollout sample exactly the policy.

A row feeds its last token and k drafted ones (d_1..d_k) through one forward and gets the policy's distributions
p_0..p_k at those k + 1 positions. The drafts come from text (`qerl.rollout.drafts`), not from a draft model, so the
draft distribution q is a point mass on d_j, and speculative sampling's rule (Leviathan et al. 2023; Chen et al.
2023) reduces to: accept d_j with probability min(1, p(d_j) / q(d_j)) = p_{j-1}(d_j); at the first rejection draw the
token from the residual (p - q)+, which is p with d_j removed and renormalised; when all k are accepted draw one more
token from p_k. Then P(emit x) = p(x) for every x at every position: the rollout is a draw from the policy at the
run's temperature / top-k / top-p, whatever the drafts were, and its log-probs are the policy's own (the full
tempered distribution's, as `sampling.sample_tokens` reports them). Greedy (temperature 0): a draft is accepted iff
it is the argmax, so the output is plain greedy decoding's.

Random numbers are counter-based: a uniform is a hash of (the row's key, the completion position, a stream), so a
row draws the same numbers whatever batch it is in and however many rows are live, on any device, with no
generator state to carry (the engine derives each row's key from its seed). Each position's accept test and its
final draw use different streams, and no (key, position, stream) is used twice in a row's rollout.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from qerl.rollout.sampling import restrict

__all__ = ["verify", "uniforms", "ACCEPT", "DRAW"]

ACCEPT, DRAW = 0, 1  # the streams of a position's accept test and of its final draw


def _signed(x: int) -> int:
    """A 64-bit constant as torch's int64 holds it."""
    return x - 2**64 if x >= 2**63 else x


_GOLDEN, _M1, _M2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shift_right(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: Tensor) -> Tensor:
    """splitmix64's finaliser on int64 (multiplications wrap, as the algorithm's unsigned ones do)."""
    x = x + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _M1
    x = (x ^ _shift_right(x, 27)) * _M2
    return x ^ _shift_right(x, 31)


def uniforms(keys: Tensor, positions: Tensor, stream: int, lanes: int = 0) -> Tensor:
    """float32 uniforms in (0, 1), one per element of `positions` (broadcast with `keys`), or with `lanes` > 0 one per
    (element, lane) in a trailing axis (a draw over the vocabulary): a hash of key, position, stream and lane."""
    x = _mix(_mix(keys * 4 + stream) ^ positions)
    if lanes:
        x = _mix(x[..., None] ^ torch.arange(lanes, device=x.device))
    return (_shift_right(x, 40).to(torch.float32) + 0.5) * 2.0 ** -24


def verify(logits: Tensor, drafts: Tensor, draft_len: Tensor, keys: Tensor, positions: Tensor, temperature: float,
           top_p: float = 1.0, top_k: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Accept a prefix of each row's drafts and draw the token after it.

    logits [B, T, V] fp32: position t of row b predicts the token after its t-th input (input 0 is the row's last
    token, inputs 1..T-1 its drafts); drafts [B, T - 1] (entries past draft_len [B] are ignored); keys [B] int64,
    the rows' sampling keys; positions [B] int64: the completion index of the token logits[:, 0] predicts.
    Returns (tokens [B, T], log-probs [B, T], accepted [B]): row b emits tokens[b, :accepted[b] + 1] (its accepted
    drafts, then the drawn token), with their log-probs under the full tempered distribution.
    """
    rows, t, vocab = logits.shape
    dev = logits.device
    lanes = torch.arange(t - 1, device=dev)
    proposed = lanes < draft_len[:, None]
    safe = torch.where(proposed, drafts, 0)
    if temperature == 0:
        target = logits.argmax(-1)
        ok = proposed & (safe == target[:, :-1])
        logprobs = F.log_softmax(logits, -1)
    else:
        scaled = logits / temperature
        logprobs = F.log_softmax(scaled, -1)
        probs = restrict(scaled.view(rows * t, vocab), top_p, top_k).softmax(-1).view(rows, t, vocab)
        p_draft = probs[:, :-1].gather(-1, safe[..., None])[..., 0]
        ok = proposed & (uniforms(keys[:, None], positions[:, None] + lanes, ACCEPT) < p_draft)
    accepted = ok.to(torch.long).cumprod(-1).sum(-1)  # the leading run of accepted drafts
    at = accepted[:, None]
    if temperature == 0:
        final = target.gather(-1, at)[:, 0]
    else:
        p = probs.gather(1, at[:, :, None].expand(rows, 1, vocab))[:, 0]  # [B, V]: the distribution after them
        rejected = accepted < draft_len  # draw from the residual: p without the rejected draft
        residual = p.scatter(-1, safe.gather(-1, at.clamp(max=t - 2)) if t > 1 else at, 0.0)
        # p(d) may round below 1 where the draft held all the (restricted) mass: keep p then, never an empty race
        residual = torch.where(rejected[:, None] & (residual.sum(-1, keepdim=True) > 0), residual, p)
        # Exponential race: argmax(p / E), E ~ Exp(1), is an exact draw from p (unnormalised p is fine)
        noise = -torch.log(uniforms(keys, positions + accepted, DRAW, lanes=vocab))
        final = (residual / noise).argmax(-1)
    out = torch.cat([safe, final[:, None]], 1)
    out = torch.where(torch.arange(t, device=dev) == at, final[:, None], out)
    return out, logprobs.gather(-1, out[..., None])[..., 0], accepted
