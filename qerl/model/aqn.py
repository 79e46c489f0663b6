"""Adaptive Quantization Noise (AQN, QeRL arXiv 2510.11696 Sec. 3.3).

The paper adds a channel-wise Gaussian vector ``Z ~ N(0, sigma^2 I)`` to the input of each
quantized linear layer's weight. Since ``x_norm @ (diag(w + Z) W) == RMSNorm_{w+Z}(x) @ W``, the
vector is merged into the RMSNorm scale that feeds those layers: q/k/v, which all read
``input_layernorm``, share one draw, and gate/up, which read ``post_attention_layernorm``, share
another. No extra parameters, and the NVFP4 x BF16 kernels are untouched.

Reference implementation: NVlabs/QeRL (the paper's code; read from its mirror
vukrosic/QeRL-learn @ 1bf4803c):
  * ``trl_trainer/noise_scheduler.py``: ``get_sigma_by_step`` (stage layout) and
    ``generate_gaussian_noise``: for every ``Qwen2RMSNorm``/``LlamaRMSNorm`` module (the final
    norm included), ``weight += N(0, sigma^2)`` of the weight's shape (one independent vector
    per norm), drawn in float32 and cast to the weight dtype; sigma == 0 adds nothing.
  * ``trl_trainer/grpo_trainer.py`` (``_move_peft_model_to_vllm``): the noisy sigmas are
    ``sigma_start * (sigma_end / sigma_start) ** (arange(num_stages - 1) / (num_stages - 2))``,
    and the noise goes into the rollout engine's (vLLM's) weights once per RL step, right after
    the trainer's clean weights are synced in: rollouts sample from the noisy policy, the
    training forward uses clean weights.

Caveat: bf16 has 8 significant bits, so a noise much smaller than ``|w| * 2**-9`` mostly rounds
away in bf16 norm weights (e.g. sigma = 5e-4 around w = 1). The reference has the same property.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor, nn

# Per-head norms (Qwen3, Gemma3...) normalise q/k *after* their projections, so noise there is
# not the paper's "noise on a quantized layer's input channels"; the reference never touched them.
_PER_HEAD_NORMS = ("q_norm", "k_norm")


@dataclass
class AQNSchedule:
    """Piecewise-constant, exponentially decaying noise scale (paper Eq. 8, reference code).

    ``total_steps`` are split into ``num_stages`` equal stages; stage ``k`` covers steps
    ``[k * total_steps / num_stages, (k + 1) * total_steps / num_stages)``, and steps past the
    end stay in the last stage. Stage 0 adds no noise (the model's own quantization noise drives
    early exploration); stage ``k >= 1`` uses

        sigma_k = sigma_start * (sigma_end / sigma_start) ** ((k - 1) / (num_stages - 2))

    so stage 1 is ``sigma_start`` and the last stage ``sigma_end`` (with ``num_stages == 2`` the
    one noisy stage uses ``sigma_start``; the reference divides by zero there). This is the
    reference's ``get_sigma_by_step`` with the stage index computed in exact integer arithmetic
    (``step * num_stages // total_steps``) instead of ``int(step // (total_steps / num_stages))``,
    whose float rounding can put a stage boundary one step late.
    """

    sigma_start: float = 1e-2
    sigma_end: float = 5e-4
    num_stages: int = 10
    total_steps: int = 100

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.total_steps < 1:
            raise ValueError("num_stages and total_steps must be >= 1")
        if self.sigma_start <= 0 or self.sigma_end <= 0:
            raise ValueError("sigma_start and sigma_end must be positive")

    def stage(self, step: int) -> int:
        """Stage index in ``[0, num_stages)`` of the 0-based RL step ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        step = min(step, self.total_steps)
        return min(step * self.num_stages // self.total_steps, self.num_stages - 1)

    def sigma(self, step: int) -> float:
        """Noise std for the rollouts of the 0-based RL step ``step`` (0.0 in stage 0)."""
        k = self.stage(step)
        if k == 0:
            return 0.0
        if self.num_stages == 2:
            return self.sigma_start
        return self.sigma_start * (self.sigma_end / self.sigma_start) ** ((k - 1) / (self.num_stages - 2))

    # The geometric schedule is a pure function of the step: nothing to observe, nothing to checkpoint.
    def observe(self, entropy: float) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {}

    def load_state_dict(self, state: dict[str, float]) -> None:
        pass


@dataclass
class EntropyTargetedSchedule:
    """Beyond the paper: sigma steered by the policy's entropy instead of fixed in advance.

    After every RL step the trainer reports the policy's mean per-token entropy on that step's completions
    (:meth:`observe`). Below ``target_entropy`` the next rollouts get a larger sigma (``sigma * rate``), at or above
    it a smaller one (``sigma / rate``), always clipped to ``[sigma_min, sigma_max]``. So noise is spent where the
    policy has collapsed and withdrawn once it explores on its own, rather than decaying on a fixed clock whether
    or not the policy needed it. The first rollouts use ``sigma_start``.

    The state is one float, saved in every checkpoint, so a resumed run replays the same sigmas bit for bit.
    """

    target_entropy: float
    sigma_start: float = 1e-2
    sigma_min: float = 5e-4
    sigma_max: float = 5e-2
    rate: float = 1.5

    def __post_init__(self) -> None:
        if self.target_entropy <= 0:
            raise ValueError(f"target_entropy must be > 0, got {self.target_entropy}")
        if not 0 < self.sigma_min <= self.sigma_start <= self.sigma_max:
            raise ValueError(f"need 0 < sigma_min <= sigma_start <= sigma_max, got {self.sigma_min}, "
                             f"{self.sigma_start}, {self.sigma_max}")
        if self.rate <= 1:
            raise ValueError(f"rate must be > 1, got {self.rate}")
        self.current = self.sigma_start

    def sigma(self, step: int) -> float:
        """The sigma for the next rollouts (``step`` is accepted for the schedules' common interface)."""
        return self.current

    def observe(self, entropy: float) -> None:
        """Move sigma one notch towards the target after a step whose policy entropy was ``entropy``."""
        factor = self.rate if entropy < self.target_entropy else 1 / self.rate
        self.current = min(self.sigma_max, max(self.sigma_min, self.current * factor))

    def state_dict(self) -> dict[str, float]:
        return {"sigma": self.current}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.current = state["sigma"]


def build_schedule(aqn, total_steps: int) -> "AQNSchedule | EntropyTargetedSchedule | None":
    """The schedule `aqn` (a `qerl.config.AQNSettings`) asks for; None when AQN is off, so sigma is 0 throughout.

    Config allows both geometric sigmas at 0 as another way to say "off".
    """
    if not aqn.enabled:
        return None
    if aqn.schedule == "entropy":
        return EntropyTargetedSchedule(aqn.target_entropy, aqn.sigma_start, aqn.sigma_min, aqn.sigma_max,
                                       aqn.sigma_rate)
    if aqn.sigma_start <= 0 or aqn.sigma_end <= 0:
        return None
    return AQNSchedule(aqn.sigma_start, aqn.sigma_end, aqn.num_stages, total_steps)


def norm_weights(
    model: nn.Module, include_final_norm: bool = True, include_qk_norm: bool = False
) -> list[tuple[str, nn.Parameter]]:
    """Every RMSNorm weight of ``model``: modules whose class name ends with ``"RMSNorm"``.

    Args:
        include_final_norm: also the norm outside the decoder blocks (before the LM head), as
            the reference does (it perturbs every RMSNorm module). The block norms are the
            ones whose name has a layer index (``model.layers.3.input_layernorm``).
        include_qk_norm: also per-head ``q_norm``/``k_norm`` (off: see ``_PER_HEAD_NORMS``).
    Returns:
        ``(parameter name, parameter)`` in module order, each parameter once.
    """
    found, seen = [], set()
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not type(module).__name__.endswith("RMSNorm") or not isinstance(weight, nn.Parameter):
            continue
        parts = name.split(".")
        if not include_final_norm and not any(part.isdigit() for part in parts):
            continue
        if not include_qk_norm and parts[-1] in _PER_HEAD_NORMS:
            continue
        if id(weight) not in seen:
            seen.add(id(weight))
            found.append((f"{name}.weight", weight))
    return found


class NoiseInjector:
    """Adds AQN to a model's RMSNorm weights in place and removes it bit-exactly.

    In place (``copy_`` into the existing storage), so captured CUDA graphs and any engine that
    holds the tensors keep seeing the live weights. Removal copies back a clean snapshot taken
    by :meth:`apply`: subtracting the noise again would not round-trip in bf16. Apply noise for
    rollout generation only and remove it before an optimizer step touches the weights.
    """

    def __init__(
        self, model: nn.Module, include_final_norm: bool = True, include_qk_norm: bool = False
    ) -> None:
        self.targets = norm_weights(model, include_final_norm, include_qk_norm)
        if not self.targets:
            raise ValueError("no RMSNorm weights found in the model")
        if include_qk_norm and not any(name.rsplit(".", 2)[-2] in _PER_HEAD_NORMS for name, _ in self.targets):
            # a setting that would change nothing says so (families with them: Qwen3, Gemma3)
            raise ValueError("aqn.include_qk_norm = true, but the model has no per-head q_norm/k_norm weights")
        self._clean: list[Tensor] | None = None

    @property
    def active(self) -> bool:
        """True while noise is applied."""
        return self._clean is not None

    @torch.no_grad()
    def apply(self, sigma: float, seed: int) -> None:
        """Add fresh ``N(0, sigma^2)`` noise (one vector per norm weight) drawn from a generator
        seeded with ``seed`` on the weights' device. ``sigma == 0`` is a no-op.

        Raises:
            RuntimeError: noise is already applied (stacking would lose the clean snapshot).
        """
        if self.active:
            raise RuntimeError("AQN noise is already applied; call remove() first")
        if sigma < 0:
            raise ValueError(f"sigma must be >= 0, got {sigma}")
        if sigma == 0:
            return
        self._clean = [weight.detach().clone() for _, weight in self.targets]
        generators: dict[torch.device, torch.Generator] = {}
        for _, weight in self.targets:
            if weight.device not in generators:
                generators[weight.device] = torch.Generator(weight.device).manual_seed(seed)
            noise = torch.randn(weight.shape, generator=generators[weight.device], device=weight.device)
            # Add in float32 and round once to the weight dtype.
            weight.copy_(weight.float() + sigma * noise)

    @torch.no_grad()
    def remove(self) -> None:
        """Restore the clean weights bit for bit; a no-op when no noise is applied."""
        if self._clean is None:
            return
        for (_, weight), clean in zip(self.targets, self._clean):
            weight.copy_(clean)
        self._clean = None

    @contextmanager
    def noisy(self, sigma: float, seed: int) -> Iterator[None]:
        """Noise applied inside the block, removed on exit (also on an exception)."""
        self.apply(sigma, seed)
        try:
            yield
        finally:
            self.remove()
