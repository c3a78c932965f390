"""LLMREINFORCE: REINFORCE with a leave-one-out baseline (RLOO; Ahmadian et al., arXiv:2402.14740).

GRPO's rollout and reference, with the plain policy gradient of each completion's whole
log-likelihood. The baseline of a completion is the mean reward of the other completions of
its prompt, so it does not depend on the completion itself and the estimator stays unbiased:

    A_i = r_i - (1 / (G - 1)) * sum_{j != i in its group} r_j
    loss = -(1 / n) * sum_i A_i * sum_t log pi(o_it)  [+ beta * each sequence's mean k3 KL]

No ratio and no clip: REINFORCE is on-policy, so ``update_epochs`` must be 1. ``beta`` keeps
GRPO's default 0.04 against the reference (disabled adapters, or a reference adapter).
"""

from __future__ import annotations

import torch

from .grpo import GRPO, k3_kl

__all__ = ["LLMREINFORCE", "leave_one_out_advantages", "reinforce_loss"]


def leave_one_out_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``r_i`` less the mean reward of the other ``group_size - 1`` completions of its group."""
    grouped = rewards.float().view(-1, group_size)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others).view(-1)


def reinforce_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The REINFORCE objective on token log-probs ``[n, T]`` (module doc)."""
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)
    per_sequence = -adv * (logp * mask).sum(dim=1)
    kl = torch.zeros_like(logp)
    if beta != 0.0 and ref_logp is not None:
        kl = k3_kl(logp, ref_logp)
        per_sequence = per_sequence + beta * (kl * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    loss = per_sequence.mean()
    with torch.no_grad():
        stats = {"kl": (kl * mask).sum() / mask.sum().clamp(min=1.0), "clip_fraction": torch.zeros(())}
    return loss, stats


class LLMREINFORCE(GRPO):
    """GRPO's loop with REINFORCE and a leave-one-out baseline (module doc); every other argument
    as :class:`GRPO`, except ``clip_coef`` (nothing is clipped) and ``update_epochs`` (1)."""

    algo_name = "LLMREINFORCE"

    def __init__(
        self, model_name: str | None = None, *, clip_coef: float | None = None, update_epochs: int = 1, **kwargs
    ) -> None:
        if clip_coef is not None:
            raise ValueError("LLMREINFORCE clips nothing (no importance ratio): drop clip_coef")
        if update_epochs != 1:
            raise ValueError(f"LLMREINFORCE is on-policy: update_epochs must be 1, got {update_epochs}")
        super().__init__(model_name, update_epochs=1, **kwargs)

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return leave_one_out_advantages(rewards, self.group_size)

    def policy_loss(self, logp, old_logp, ref_logp, advantages, mask):
        return reinforce_loss(logp, ref_logp, advantages, mask, beta=self.beta)
