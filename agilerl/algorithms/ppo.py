"""LLMPPO: PPO with a value head for LLM fine-tuning (Ouyang et al., arXiv:2203.02155; the
token-level recipe of TRL's PPOTrainer).

GRPO's rollout (``get_action``: ``group_size`` completions per prompt, 1 by default); then:

1. One no-grad pass (phase ``reference``): the reference policy's log-probs (when
   ``beta > 0``), and the sampling policy's log-probs and values. The value head is a
   linear layer ``hidden_size -> 1`` in fp32 on the actor's final hidden states (the
   backbone is shared, its LoRA or every weight trained by both losses), trained beside
   the model with its own AdamW at ``value_lr``.
2. Per-token rewards: ``-beta * (log pi_old - log pi_ref)`` on every completion token (the
   k1 KL penalty), plus the completion's reward on its last token.
3. Generalised advantage estimation over each completion (Schulman et al., arXiv:1506.02438):
   ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lambda A_{t+1}``, with
   V = 0 past the completion's end; returns ``R_t = A_t + V_t``; advantages whitened over the
   rank's completion tokens.
4. ``update_epochs`` passes of micro-batches (phase ``learn``), each

       loss = mean_t max(-A_t rho_t, -A_t clip(rho_t, 1 - eps, 1 + eps))
              + vf_coef * 0.5 * mean_t max((V_t - R_t)^2, (clip(V_t, V_old - eps_v, V_old + eps_v) - R_t)^2)

   with ``rho_t = exp(log pi - log pi_old)`` and means over the micro-batch's completion
   tokens; the optimizer steps after each pass (phase ``step``).

Defaults follow TRL's PPOConfig: ``beta=0.05`` (its kl_coef), ``clip_coef=0.2``,
``clip_coef_value=0.2``, ``vf_coef=0.1``, ``gamma=1.0``, ``gae_lambda=0.95``,
``update_epochs=4``, whitened advantages; one completion per prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from agilerl.distributed import aggregate_metrics_dict

from .core.adapters import ACTOR, REFERENCE, use_adapter
from .core.base import check_hyperparameters
from .grpo import GRPO

__all__ = ["LLMPPO", "gae_advantages", "ppo_loss", "token_rewards", "masked_whiten"]


def token_rewards(
    old_logp: torch.Tensor, ref_logp: torch.Tensor | None, rewards: torch.Tensor, mask: torch.Tensor, *, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards ``[n, L]``: ``-beta`` times the k1 KL estimate on completion tokens, and
    each completion's reward on its last token; with the KL estimate itself."""
    mask = mask.to(old_logp.dtype)
    kl = (old_logp - ref_logp) * mask if ref_logp is not None else torch.zeros_like(old_logp)
    out = -beta * kl
    last = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(dim=1)
    out[torch.arange(mask.shape[0], device=mask.device), last] += rewards.to(out.dtype)
    return out * mask, kl


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns ``[n, L]`` by GAE (module doc), values read as 0 outside ``mask``."""
    mask = mask.to(values.dtype)
    values = values * mask
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    length = values.shape[1]
    for t in range(length - 1, -1, -1):
        next_value = values[:, t + 1] if t + 1 < length else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    return advantages, advantages + values


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the masked entries (unbiased variance, as TRL)."""
    mask = mask.to(values.dtype)
    count = mask.sum().clamp(min=2.0)
    mean = (values * mask).sum() / mask.sum().clamp(min=1.0)
    var = (((values - mean) * mask) ** 2).sum() / (count - 1)
    return (values - mean) * torch.rsqrt(var + eps)


def ppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_coef: float,
    clip_coef_value: float,
    vf_coef: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped policy loss plus ``vf_coef`` times the clipped value loss (module doc), masked
    means over the micro-batch's completion tokens."""
    mask = mask.to(logp.dtype)
    total = mask.sum().clamp(min=1.0)
    ratio = torch.exp(logp - old_logp)
    pg = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - clip_coef, 1.0 + clip_coef))
    pg_loss = (pg * mask).sum() / total
    clipped = old_values + torch.clamp(values - old_values, -clip_coef_value, clip_coef_value)
    vf = torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    vf_loss = 0.5 * (vf * mask).sum() / total
    with torch.no_grad():
        stats = {
            "policy_loss": pg_loss.detach(),
            "value_loss": vf_loss.detach(),
            "clip_fraction": (((ratio - 1.0).abs() > clip_coef).to(mask.dtype) * mask).sum() / total,
            "value_clip_fraction": (((values - old_values).abs() > clip_coef_value).to(mask.dtype) * mask).sum()
            / total,
        }
    return pg_loss + vf_coef * vf_loss, stats


class LLMPPO(GRPO):
    """PPO with a value head (module doc); every other argument as :class:`GRPO`.

    ``group_size`` completions per prompt (1: PPO needs no group, the value head is its
    baseline). ``value_lr``: the value head's learning rate (default: ``lr``).
    """

    algo_name = "LLMPPO"
    min_group_size = 1
    extra_hyperparameters = ("vf_coef", "clip_coef_value", "gamma", "gae_lambda", "whiten_advantages", "value_lr")

    def __init__(
        self,
        model_name: str | None = None,
        *,
        group_size: int = 1,
        beta: float = 0.05,
        update_epochs: int = 4,
        vf_coef: float = 0.1,
        clip_coef_value: float = 0.2,
        gamma: float = 1.0,
        gae_lambda: float = 0.95,
        whiten_advantages: bool = True,
        value_lr: float | None = None,
        **kwargs,
    ) -> None:
        check_hyperparameters(vf_coef=vf_coef, clip_coef_value=clip_coef_value, gamma=gamma, gae_lambda=gae_lambda)
        if value_lr is not None:
            check_hyperparameters(value_lr=value_lr)
        self.vf_coef = vf_coef
        self.clip_coef_value = clip_coef_value
        self.gamma = gamma
        self.gae_lambda = gae_lambda
        self.whiten_advantages = bool(whiten_advantages)
        super().__init__(model_name, group_size=group_size, beta=beta, update_epochs=update_epochs, **kwargs)
        self.value_lr = self.lr if value_lr is None else value_lr
        from agilerl.utils.logprobs import causal_lm

        generator = torch.Generator().manual_seed(self.seed)  # the same head on every rank
        head = nn.Linear(causal_lm(self.model).config.hidden_size, 1)
        with torch.no_grad():
            bound = head.in_features**-0.5  # nn.Linear's own init, drawn from the seed
            head.weight.uniform_(-bound, bound, generator=generator)
            head.bias.uniform_(-bound, bound, generator=generator)
        self.value_head = self.add_head("value_head", head, lr=self.value_lr)

    def _logprobs_and_values(
        self, ids: torch.Tensor, attention: torch.Tensor, first: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The actor's log-probs ``[n, T - 1]`` and its values at the same positions (0 before
        ``first``): the value head on the final hidden states, in fp32."""
        hidden: dict[str, torch.Tensor] = {}
        with use_adapter(self.model, ACTOR):
            logp = self.token_logprobs(ids, attention, first, hidden=hidden)
        h, offset = hidden["h"], hidden["offset"]
        states = h[:, first - offset : ids.shape[1] - 1 - offset]
        values = self.value_head(states.float()).squeeze(-1)
        return logp, F.pad(values, (first, 0))

    @torch.no_grad()
    def _sampling_pass(
        self, ids: torch.Tensor, attention: torch.Tensor, first: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        was_training = self.model.training
        self.model.eval()
        try:
            parts = [self._logprobs_and_values(ids[s], attention[s], first) for s in self._micro_batches(ids.shape[0])]
        finally:
            self.model.train(was_training)
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def learn(self, experiences: Sequence[torch.Tensor]) -> dict[str, float]:
        """One PPO update on ``(ids, action_masks, rewards)`` from :meth:`get_action`.

        Returns metrics reduced across ranks: ``loss``, ``policy_loss``, ``value_loss``, ``kl``,
        ``clip_fraction``, ``value_clip_fraction``, ``grad_norm``, ``mean_reward`` and
        ``completion_length``.
        """
        ids, action_masks, rewards = experiences[0].to(self.device), experiences[1].to(self.device), experiences[2]
        rewards = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1).to(self.device)
        n = ids.shape[0]
        if rewards.numel() != n:
            raise ValueError(f"got {rewards.numel()} rewards for {n} completions")
        attention = self._attention_mask(ids, action_masks)
        mask = action_masks[:, 1:].float()
        first = self._first_scored(mask)
        with self._phase("reference"), self._gathered_for_reference():
            ref_logp = None
            if self.beta != 0.0:
                ref_logp = self._no_grad_logprobs(
                    ids, attention, REFERENCE if self.use_separate_reference_adapter else None, first
                )
            old_logp, old_values = self._sampling_pass(ids, attention, first)
        per_token, kl = token_rewards(old_logp, ref_logp, rewards, mask, beta=self.beta)
        advantages, returns = gae_advantages(per_token, old_values, mask, gamma=self.gamma, lam=self.gae_lambda)
        if self.whiten_advantages:
            advantages = masked_whiten(advantages, mask)
        keys = ("loss", "policy_loss", "value_loss", "clip_fraction", "value_clip_fraction")
        sums = dict.fromkeys(keys, 0.0)
        norms = []
        count = n // self.micro_batch_size_per_gpu
        for _ in range(self.update_epochs):
            for s in self._learn_micro_batches(n):
                logp, values = self._logprobs_and_values(ids[s], attention[s], first)
                loss, stats = ppo_loss(
                    logp,
                    old_logp[s],
                    advantages[s],
                    values,
                    old_values[s],
                    returns[s],
                    mask[s],
                    clip_coef=self.clip_coef,
                    clip_coef_value=self.clip_coef_value,
                    vf_coef=self.vf_coef,
                )
                (loss / count).backward()
                share = count * self.update_epochs
                sums["loss"] += float(loss.detach()) / share
                for k in keys[1:]:
                    sums[k] += float(stats[k]) / share
            with self._phase("step"):
                norms.append(float(self._optimizer_step()))
        self.steps += 1
        mean_reward = float(rewards.mean())
        self.scores.append(mean_reward)
        metrics = {
            **sums,
            "kl": float((kl * mask).sum() / mask.sum().clamp(min=1.0)),
            "grad_norm": sum(norms) / len(norms),
            "mean_reward": mean_reward,
            "completion_length": float(action_masks.sum(dim=1).float().mean()),
        }
        return aggregate_metrics_dict(metrics, maximized=("grad_norm",))
