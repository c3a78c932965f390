"""Shared builders for the GRPO tests."""

from __future__ import annotations

import math

import torch

from agilerl.utils.tiny import char_tokenizer

TINY = "tiny:qwen2?hidden_size=32&intermediate_size=64&num_layers=2&initializer_range=0.1"
TOKENIZER = char_tokenizer()


def make_agent(**overrides):
    from peft import LoraConfig

    from agilerl.algorithms import GRPO

    kwargs = dict(
        pad_token_id=TOKENIZER.pad_token_id,
        pad_token=TOKENIZER.pad_token,
        tokenizer=TOKENIZER,
        lora_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM"),
        batch_size=2,
        group_size=4,
        max_output_tokens=4,
        dtype="float32",
        device="cpu",
        gradient_checkpointing=False,
        lr=1e-2,
        beta=0.1,
        logprob_chunk_size=7,
        gather_weights_for_rollout=False,
        seed=0,
    )
    kwargs.update(overrides)
    model_name = kwargs.pop("model_name", TINY)
    algorithm = kwargs.pop("algorithm", GRPO)  # or a class built on GRPO's loop (CISPO, GSPO, LLMREINFORCE)
    return algorithm(model_name, **kwargs)


def synthetic_experiences(
    agent, num_prompts: int = 2, prompt_len: int = 5, completion_len: int = 6, seed: int = 0, grouped: bool = False
):
    """Global experiences of fixed shape; returns this rank's slice and all rewards.

    ``grouped``: as real rollouts, the rows of a group share their prompt, left-padded to
    ``prompt_len`` (group g's prompt has ``prompt_len - g`` tokens); else every row is random."""
    g = torch.Generator().manual_seed(seed)
    total = num_prompts * agent.group_size
    vocab = len(TOKENIZER)
    ids = torch.randint(4, vocab, (total, prompt_len + completion_len), generator=g)
    if grouped:
        for p in range(num_prompts):
            rows = slice(p * agent.group_size, (p + 1) * agent.group_size)
            ids[rows, :prompt_len] = ids[p * agent.group_size, :prompt_len]
            ids[rows, : min(p, prompt_len - 1)] = agent.pad_token_id
    masks = torch.zeros_like(ids)
    lengths = torch.randint(1, completion_len + 1, (total,), generator=g)
    for i, n in enumerate(lengths.tolist()):
        masks[i, prompt_len : prompt_len + n] = 1
        ids[i, prompt_len + n :] = agent.pad_token_id
    rewards = torch.rand(total, generator=g)
    s = agent.local_slice(num_prompts)
    return ids[s], masks[s], rewards[s], rewards


def lora_state(agent, adapter: str = "actor") -> dict[str, torch.Tensor]:
    from agilerl.algorithms.core.adapters import adapter_state_dict
    from agilerl.distributed import full_model_state_dict

    keys = set(adapter_state_dict(agent.model, adapter))
    return {k: v.clone() for k, v in full_model_state_dict(agent.model).items() if k in keys}


def loop_loss(logp, old, ref, adv, mask, clip, beta):
    """The objective written out token by token in plain Python."""
    seq_losses = []
    for i in range(len(logp)):
        total, count = 0.0, 0
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            ratio = math.exp(logp[i][t] - old[i][t])
            clipped = min(max(ratio, 1 - clip), 1 + clip)
            term = -min(ratio * adv[i], clipped * adv[i])
            d = ref[i][t] - logp[i][t]
            term += beta * (math.exp(d) - d - 1)
            total += term
            count += 1
        seq_losses.append(total / max(count, 1))
    return sum(seq_losses) / len(seq_losses)
