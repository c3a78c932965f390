"""SFT: supervised fine-tuning on prompt-completion pairs, the loss on the completion only.

    loss = -(1 / N) * sum over every completion token t of the step of log p(y_t | y_<t, prompt)

``N`` counts the completion tokens of the whole step, across micro-batches and ranks (as
TRL's SFTTrainer normalises by the batch's token count), so the update does not depend on
how the batch is split. The prompt's tokens are context only (TRL's
``completion_only_loss`` for prompt-completion data). No rollout and no reference pass:
one ``learn`` phase per micro-batch and the optimizer ``step``.

Defaults follow upstream AgileRL's SFT: ``lr=5e-5`` (LoRA), ``batch_size=16`` examples per
step, gradient-norm clip 1.0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from agilerl.distributed import aggregate_metrics_dict

from .core.adapters import ACTOR, use_adapter
from .core.base import DEFAULT_LORA, LLMAlgorithm, check_counts
from .core.pairs import check_length, completion_batch, encode_pairs

__all__ = ["SFT", "sft_loss"]


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, total_tokens: float) -> torch.Tensor:
    """The summed negative log-likelihood of the masked tokens, over ``total_tokens`` (module doc)."""
    return -(logp * mask.to(logp.dtype)).sum() / total_tokens


class SFT(LLMAlgorithm):
    """Supervised fine-tuning of a LoRA actor (or, with ``lora_config=None``, every parameter).

    ``batch_size`` is the number of examples per step across all ranks; ``learn`` takes this
    rank's share. ``micro_batch_size_per_gpu``, ``fsdp_config``, ``logprob_chunk_size`` and
    ``gradient_checkpointing`` are as in :class:`~agilerl.algorithms.GRPO`.
    """

    algo_name = "SFT"
    group_size = 1

    def __init__(
        self,
        model_name: str | None = None,
        *,
        actor_network: nn.Module | None = None,
        pad_token_id: int | None = None,
        pad_token: str | None = None,
        lora_config=DEFAULT_LORA,
        batch_size: int = 16,
        lr: float = 5e-5,
        max_grad_norm: float = 1.0,
        max_model_len: int | None = None,
        micro_batch_size_per_gpu: int | None = None,
        logprob_chunk_size: int | None | str = "auto",
        gradient_checkpointing: bool | str = "auto",
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
        self.batch_size = batch_size
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
            use_separate_reference_adapter=False,
            load_in_4bit=load_in_4bit,
            device=device,
            dtype=dtype,
            attn_implementation=attn_implementation,
            seed=seed,
            index=index,
            tokenizer=tokenizer,
        )
        self.eos_token_id = self._eos_token_id()

    def encode(self, prompts: Sequence[str], completions: Sequence[str]) -> dict[str, torch.Tensor]:
        """Text pairs as a batch ``learn`` takes (the completion followed by the end-of-sequence token).

        With ``max_model_len`` set, a wider batch is cut to it: prompts keep their last tokens (at
        least half of ``max_model_len``), completions their first.
        """
        eos = self.completion_eos_id()
        return encode_pairs(
            self.tokenizer,
            prompts,
            completions,
            eos_token_id=eos,
            pad_token_id=self.pad_token_id,
            max_len=self.max_model_len,
        )

    def learn(self, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """One update on this rank's examples.

        ``batch``: ``input_ids`` ``[n, T]``, ``attention_mask`` (default: every token) and either
        ``completion_mask`` (1 on the tokens to learn; :meth:`encode` makes it) or
        ``prompt_lengths`` (upstream AgileRL's right-padded layout: the completion starts there;
        it needs the attention mask). A batch wider than ``max_model_len`` tokens is refused.
        Returns ``loss`` (the mean token negative log-likelihood of the step), ``perplexity``,
        ``grad_norm`` and ``completion_tokens`` (per rank), reduced across ranks.
        """
        ids, attention, completion = completion_batch(batch, who="SFT.learn")
        check_length(ids, self.max_model_len, who="SFT.learn")
        expected = self.sequences_per_step // self.data_parallel_ranks
        if ids.shape[0] != expected:
            raise ValueError(
                f"SFT.learn got {ids.shape[0]} examples; a rank's share of batch_size="
                f"{self.batch_size} over {self.data_parallel_ranks} data-parallel ranks is {expected}"
            )
        ids, attention, completion = ids.to(self.device), attention.to(self.device), completion.to(self.device)
        mask = completion[:, 1:]
        first = self._first_scored(mask)
        local_tokens = float(mask.sum())
        total_tokens = self._dp_sum(local_tokens)
        summed = 0.0
        for s in self._learn_micro_batches(ids.shape[0]):
            with use_adapter(self.model, ACTOR):
                logp = self.token_logprobs(ids[s], attention[s], first)
            # Gradients are averaged over the data-parallel ranks: each rank's share of the
            # step's token mean is scaled back up by their number.
            loss = sft_loss(logp, mask[s], total_tokens / self.data_parallel_ranks)
            loss.backward()
            summed += float(-(logp.detach() * mask[s]).sum())
        with self._phase("step"):
            norm = float(self._optimizer_step())
        self.steps += 1
        mean_nll = self._dp_sum(summed) / total_tokens
        self.scores.append(-mean_nll)
        metrics = {
            "loss": mean_nll,
            "perplexity": float(torch.tensor(mean_nll).exp()),
            "grad_norm": norm,
            "completion_tokens": local_tokens,
        }
        return aggregate_metrics_dict(metrics, maximized=("grad_norm",))
