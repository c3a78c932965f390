"""CISPO: clipped importance-sampling-weight policy optimisation (MiniMax-M1, arXiv:2506.13585).

GRPO's rollout, reference and group advantages; only the objective differs. Where PPO and
GRPO clip the update (a token whose ratio leaves the clip range stops contributing a
gradient), CISPO clips the importance weight and keeps every token's gradient:

    loss = -(1 / sum |o_i|) * sum_i sum_t sg(min(r_it, 1 + eps_high)) * A_i * log pi(o_it)

with ``r_it = exp(logp - old_logp)`` and ``sg`` the stop-gradient. Defaults follow the paper's
recipe: no lower bound on the weight, no KL term (``beta=0``), and a wide upper bound
(``clip_coef_high=4.0``: weights truncated at 5). The mean is over every completion token of
the step, on every rank, as the paper normalises by the tokens of the batch rather than per
sequence: :func:`cispo_loss` is a micro-batch's token mean, which GRPO's loop reweights by the
micro-batch's share of the step's tokens (``step_token_mean``), so the gradient does not depend
on ``micro_batch_size_per_gpu`` or on how the step's sequences fall on the ranks.
"""

from __future__ import annotations

import torch

from .core.base import check_hyperparameters
from .grpo import GRPO, k3_kl

__all__ = ["CISPO", "cispo_loss"]


def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_coef_high: float,
    beta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The CISPO objective on token log-probs ``[n, T]`` (module doc), plus ``beta`` times the k3
    KL estimator against ``ref_logp``; ``clip_fraction`` is the share of tokens whose weight was
    truncated."""
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(1)
    ratio = torch.exp(logp - old_logp).detach()
    weight = torch.clamp(ratio, max=1.0 + clip_coef_high)
    per_token = -weight * adv * logp
    kl = torch.zeros_like(logp)
    if beta != 0.0 and ref_logp is not None:
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + beta * kl
    total = mask.sum().clamp(min=1.0)
    loss = (per_token * mask).sum() / total
    with torch.no_grad():
        stats = {
            "kl": (kl * mask).sum() / total,
            "clip_fraction": ((ratio > 1.0 + clip_coef_high).to(mask.dtype) * mask).sum() / total,
        }
    return loss, stats


class CISPO(GRPO):
    """GRPO's loop with the CISPO objective (module doc); every other argument as :class:`GRPO`.

    ``clip_coef_high``: the weight's upper bound is ``1 + clip_coef_high``. There is no lower
    bound, so GRPO's ``clip_coef`` does not apply and is refused.
    """

    algo_name = "CISPO"
    extra_hyperparameters = ("clip_coef_high",)
    step_token_mean = True

    def __init__(
        self,
        model_name: str | None = None,
        *,
        beta: float = 0.0,
        clip_coef_high: float = 4.0,
        clip_coef: float | None = None,
        **kwargs,
    ) -> None:
        if clip_coef is not None:
            raise ValueError(
                "CISPO bounds the importance weight from above only: set clip_coef_high "
                "(the weight is capped at 1 + clip_coef_high), not clip_coef"
            )
        check_hyperparameters(clip_coef_high=clip_coef_high)
        self.clip_coef_high = float(clip_coef_high)
        super().__init__(model_name, beta=beta, **kwargs)

    def policy_loss(self, logp, old_logp, ref_logp, advantages, mask):
        return cispo_loss(
            logp, old_logp, ref_logp, advantages, mask, clip_coef_high=self.clip_coef_high, beta=self.beta
        )
