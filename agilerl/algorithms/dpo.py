"""DPO: direct preference optimisation (Rafailov et al., arXiv:2305.18290).

Each example is a prompt with a chosen and a rejected completion. With ``c`` and ``r`` the
summed log-probs of the chosen and rejected completions under the policy, and ``c_ref``,
``r_ref`` under the reference policy (the model with its adapters disabled, a reference
adapter, or with full fine-tuning a frozen copy of the initial model):

    loss = -(1 / P) * sum over pairs of log sigmoid(beta * ((c - c_ref) - (r - r_ref)))
           [+ nll_alpha * the mean negative log-likelihood per token of the chosen completions]

``P`` counts the step's pairs across micro-batches and ranks. The optional second term is
RPO's (Pang et al., arXiv:2404.19733; upstream AgileRL's ``nll_alpha``, there 1.0 by
default); the paper's DPO has none, so ``nll_alpha=0``. ``beta=0.1`` (the paper's, TRL's);
``lr=5e-6`` (upstream AgileRL's, for LoRA). The implicit rewards ``beta * (c - c_ref)`` and
``beta * (r - r_ref)`` are reported with their margin and how often the chosen one wins.

A pair's two sequences sit in adjacent rows (chosen, then rejected) and in the same
micro-batch, so ``micro_batch_size_per_gpu`` counts sequences and must be even. The reference
log-probs are computed once per step, without gradients (phase ``reference``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from agilerl.distributed import aggregate_metrics_dict

from .core.adapters import ACTOR, REFERENCE, use_adapter
from .core.base import DEFAULT_LORA, LLMAlgorithm, check_counts, check_hyperparameters
from .core.pairs import BatchError, check_length, completion_batch, encode_pairs

__all__ = ["DPO", "dpo_loss"]


def dpo_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    chosen_ref: torch.Tensor,
    rejected_ref: torch.Tensor,
    *,
    beta: float,
    num_pairs: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DPO term (module doc) of some pairs' summed log-probs ``[p]``, over ``num_pairs``;
    the implicit rewards' statistics beside it (sums over these pairs)."""
    chosen_reward = beta * (chosen - chosen_ref)
    rejected_reward = beta * (rejected - rejected_ref)
    loss = -F.logsigmoid(chosen_reward - rejected_reward).sum() / num_pairs
    with torch.no_grad():
        stats = {
            "chosen_reward": chosen_reward.sum(),
            "rejected_reward": rejected_reward.sum(),
            "accuracy": (chosen_reward > rejected_reward).float().sum(),
        }
    return loss, stats


class DPO(LLMAlgorithm):
    """DPO of a LoRA actor (or, with ``lora_config=None``, every parameter; the reference is then
    a frozen sharded copy). ``batch_size`` is the number of preference pairs per step across all
    ranks; ``learn`` takes this rank's share. Other arguments as :class:`~agilerl.algorithms.GRPO`.
    """

    algo_name = "DPO"
    group_size = 2  # a chosen and a rejected completion per prompt
    algorithm_hyperparameters = ("beta", "nll_alpha")

    def __init__(
        self,
        model_name: str | None = None,
        *,
        actor_network: nn.Module | None = None,
        pad_token_id: int | None = None,
        pad_token: str | None = None,
        lora_config=DEFAULT_LORA,
        batch_size: int = 16,
        beta: float = 0.1,
        nll_alpha: float = 0.0,
        lr: float = 5e-6,
        max_grad_norm: float = 1.0,
        max_model_len: int | None = None,
        micro_batch_size_per_gpu: int | None = None,
        logprob_chunk_size: int | None | str = "auto",
        gradient_checkpointing: bool | str = "auto",
        use_separate_reference_adapter: bool = False,
        load_in_4bit: bool = False,
        share_prompt_prefix: bool = True,
        fsdp_config=None,
        device: str | None = None,
        dtype: str = "bfloat16",
        attn_implementation: str | None = None,
        seed: int = 42,
        index: int = 0,
        tokenizer=None,
    ) -> None:
        check_counts(batch_size=batch_size)
        check_hyperparameters(beta=beta, nll_alpha=nll_alpha)
        if beta == 0:
            raise ValueError(f"beta must be > 0 (the implicit reward's scale), got {beta}")
        if micro_batch_size_per_gpu is not None and micro_batch_size_per_gpu % 2:
            raise ValueError(
                f"micro_batch_size_per_gpu counts sequences, a pair's two in the same micro-batch: "
                f"it must be even, got {micro_batch_size_per_gpu}"
            )
        self.batch_size = batch_size
        self.beta = beta
        self.nll_alpha = nll_alpha
        super().__init__(
            model_name=model_name,
            actor_network=actor_network,
            pad_token_id=pad_token_id,
            pad_token=pad_token,
            lora_config=lora_config,
            fsdp_config=fsdp_config,
            vllm_config=None,
            lr=lr,
            max_grad_norm=max_grad_norm,
            micro_batch_size_per_gpu=micro_batch_size_per_gpu,
            logprob_chunk_size=logprob_chunk_size,
            gradient_checkpointing=gradient_checkpointing,
            temperature=1.0,
            max_model_len=max_model_len,
            share_prompt_prefix=share_prompt_prefix,
            use_separate_reference_adapter=use_separate_reference_adapter,
            load_in_4bit=load_in_4bit,
            device=device,
            dtype=dtype,
            attn_implementation=attn_implementation,
            seed=seed,
            index=index,
            tokenizer=tokenizer,
        )
        if self.micro_batch_size_per_gpu % 2:  # a rank's whole share is whole pairs: cannot happen
            raise ValueError(f"micro_batch_size_per_gpu={self.micro_batch_size_per_gpu} splits a pair")
        self.eos_token_id = self._eos_token_id()

    @property
    def needs_reference(self) -> bool:
        return True

    def encode(self, prompts: Sequence[str], chosen: Sequence[str], rejected: Sequence[str]) -> dict[str, torch.Tensor]:
        """Text triples as a batch ``learn`` takes (each completion followed by the end-of-sequence
        token; both sides share one prompt width, so a pair's prompt columns are equal).

        With ``max_model_len`` set, a wider batch is cut to it: prompts keep their last tokens (at
        least half of ``max_model_len``; a pair's two sides alike), completions their first.
        """
        if len(chosen) != len(rejected):
            raise BatchError(f"{len(chosen)} chosen but {len(rejected)} rejected completions")
        eos = self.completion_eos_id()
        both = encode_pairs(
            self.tokenizer,
            [p for p in prompts for _ in range(2)],
            [c for pair in zip(chosen, rejected) for c in pair],
            eos_token_id=eos,
            pad_token_id=self.pad_token_id,
            max_len=self.max_model_len,
        )
        return {f"{side}_{k}": v[i::2] for k, v in both.items() for i, side in enumerate(("chosen", "rejected"))}

    def _pair_rows(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch's pairs interleaved into rows (chosen 2i, rejected 2i + 1), padded to one width."""
        for side in ("chosen", "rejected"):
            if isinstance(batch, Mapping) and f"{side}_input_ids" not in batch:
                raise BatchError(
                    f"DPO.learn: the batch has no '{side}_input_ids' (a preference pair needs a chosen "
                    f"and a rejected completion; it has {sorted(batch)})"
                )
        sides = [completion_batch(batch, prefix=f"{side}_", who="DPO.learn") for side in ("chosen", "rejected")]
        if sides[0][0].shape[0] != sides[1][0].shape[0]:
            raise BatchError(f"DPO.learn: {sides[0][0].shape[0]} chosen but {sides[1][0].shape[0]} rejected rows")
        for side in sides:
            check_length(side[0], self.max_model_len, who="DPO.learn")
        width = max(s[0].shape[1] for s in sides)
        padded = [
            [F.pad(t, (0, width - t.shape[1]), value=self.pad_token_id if j == 0 else 0) for j, t in enumerate(s)]
            for s in sides
        ]
        return tuple(torch.stack([padded[0][j], padded[1][j]], dim=1).reshape(-1, width) for j in range(3))

    def learn(self, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """One update on this rank's preference pairs.

        ``batch``: ``chosen_input_ids`` and ``rejected_input_ids`` ``[p, T]``, their
        ``*_attention_mask`` (default: every token), and either ``*_completion_mask`` (1 on the
        completion's tokens; :meth:`encode` makes them) or ``prompt_lengths`` (upstream
        AgileRL's right-padded layout, which needs the attention masks). A batch wider
        than ``max_model_len`` tokens is refused. Returns ``loss``, ``chosen_reward``, ``rejected_reward``,
        ``reward_margin``, ``reward_accuracy`` and ``grad_norm``, reduced across ranks.
        """
        ids, attention, completion = self._pair_rows(batch)
        pairs = ids.shape[0] // 2
        expected = (
            self.batch_size // self.data_parallel_ranks if self.batch_size % self.data_parallel_ranks == 0 else None
        )
        if pairs != expected:
            raise ValueError(
                f"DPO.learn got {pairs} pairs; a rank's share of batch_size={self.batch_size} over "
                f"{self.data_parallel_ranks} data-parallel ranks is {expected}"
            )
        ids, attention, completion = ids.to(self.device), attention.to(self.device), completion.to(self.device)
        mask = completion[:, 1:]
        first = self._first_scored(mask)
        fmask = mask.float()
        with self._phase("reference"):
            ref = (
                self._no_grad_logprobs(
                    ids, attention, REFERENCE if self.use_separate_reference_adapter else None, first
                )
                * fmask
            ).sum(dim=1)
        chosen_tokens = float(self._dp_sum(float(mask[0::2].sum())))
        sums = {"loss": 0.0, "chosen_reward": 0.0, "rejected_reward": 0.0, "accuracy": 0.0}
        num_pairs = pairs * self.data_parallel_ranks
        for s in self._learn_micro_batches(ids.shape[0]):
            with use_adapter(self.model, ACTOR):
                logp = self.token_logprobs(ids[s], attention[s], first)
            seq = (logp * fmask[s]).sum(dim=1)
            # gradients are averaged over the data-parallel ranks: a rank's sums over its pairs,
            # over every rank's pairs, scaled back up by their number
            loss, stats = dpo_loss(
                seq[0::2],
                seq[1::2],
                ref[s][0::2],
                ref[s][1::2],
                beta=self.beta,
                num_pairs=num_pairs / self.data_parallel_ranks,
            )
            if self.nll_alpha:
                loss = loss - self.nll_alpha * seq[0::2].sum() / (chosen_tokens / self.data_parallel_ranks)
            loss.backward()
            sums["loss"] += float(loss.detach()) / self.data_parallel_ranks
            for k in ("chosen_reward", "rejected_reward", "accuracy"):
                sums[k] += float(stats[k])
        with self._phase("step"):
            norm = float(self._optimizer_step())
        self.steps += 1
        totals = {k: self._dp_sum(v) for k, v in sums.items()}
        chosen, rejected = totals["chosen_reward"] / num_pairs, totals["rejected_reward"] / num_pairs
        self.scores.append(chosen - rejected)
        metrics = {
            "loss": totals["loss"],
            "chosen_reward": chosen,
            "rejected_reward": rejected,
            "reward_margin": chosen - rejected,
            "reward_accuracy": totals["accuracy"] / num_pairs,
            "grad_norm": norm,
        }
        return aggregate_metrics_dict(metrics, maximized=("grad_norm",))
