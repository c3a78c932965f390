"""GSPO: group sequence policy optimisation (Qwen, arXiv:2507.18071).

GRPO's rollout, reference and group advantages, with the importance ratio and its clipping
taken per sequence rather than per token. A completion's ratio is the length-normalised
likelihood ratio

    s_i = exp((1 / |o_i|) * sum_t (logp_it - old_logp_it))

and the loss the clipped surrogate on it, averaged over sequences:

    loss = -(1 / n) * sum_i min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)

Defaults follow the paper (section 5.1): ``clip_coef=3e-4`` below and ``clip_coef_high=4e-4``
above (a sequence ratio is a geometric mean, so its range is far narrower than a token's), and
no KL term (``beta=0``). With one update epoch every ratio is 1 and GSPO's gradient is the
sequence-level policy gradient; the clip matters once batches are reused (``update_epochs > 1``).
"""

from __future__ import annotations

import torch

from .core.base import check_hyperparameters
from .grpo import GRPO, k3_kl

__all__ = ["GSPO", "gspo_loss"]


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_coef: float,
    clip_coef_high: float,
    beta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GSPO objective on token log-probs ``[n, T]`` (module doc), plus ``beta`` times each
    sequence's mean k3 KL estimator; ``clip_fraction`` is the share of sequences clipped."""
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)
    tokens = mask.sum(dim=1).clamp(min=1.0)
    ratio = torch.exp(((logp - old_logp) * mask).sum(dim=1) / tokens)
    clipped = torch.clamp(ratio, 1.0 - clip_coef, 1.0 + clip_coef_high)
    per_sequence = -torch.min(ratio * adv, clipped * adv)
    kl = torch.zeros_like(logp)
    if beta != 0.0 and ref_logp is not None:
        kl = k3_kl(logp, ref_logp)
        per_sequence = per_sequence + beta * (kl * mask).sum(dim=1) / tokens
    loss = per_sequence.mean()
    with torch.no_grad():
        is_clipped = ((ratio < 1.0 - clip_coef) & (adv < 0)) | ((ratio > 1.0 + clip_coef_high) & (adv > 0))
        stats = {"kl": (kl * mask).sum() / mask.sum().clamp(min=1.0), "clip_fraction": is_clipped.to(mask.dtype).mean()}
    return loss, stats


class GSPO(GRPO):
    """GRPO's loop with the GSPO objective (module doc); every other argument as :class:`GRPO`.

    ``clip_coef`` / ``clip_coef_high``: the sequence ratio's clip range is
    ``[1 - clip_coef, 1 + clip_coef_high]``.
    """

    algo_name = "GSPO"
    extra_hyperparameters = ("clip_coef_high",)

    def __init__(
        self,
        model_name: str | None = None,
        *,
        beta: float = 0.0,
        clip_coef: float = 3e-4,
        clip_coef_high: float = 4e-4,
        **kwargs,
    ) -> None:
        check_hyperparameters(clip_coef=clip_coef, clip_coef_high=clip_coef_high)
        self.clip_coef_high = float(clip_coef_high)
        super().__init__(model_name, beta=beta, clip_coef=clip_coef, **kwargs)

    def policy_loss(self, logp, old_logp, ref_logp, advantages, mask):
        return gspo_loss(
            logp,
            old_logp,
            ref_logp,
            advantages,
            mask,
            clip_coef=self.clip_coef,
            clip_coef_high=self.clip_coef_high,
            beta=self.beta,
        )
