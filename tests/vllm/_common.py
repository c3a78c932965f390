"""Shared pieces of the real-vLLM tests (``@pytest.mark.vllm``; they run in the vLLM environment of
the README's test command)."""

from __future__ import annotations

import torch

from agilerl.utils.algo_utils import VLLMConfig
from tests.agilerl.algorithms._common import make_agent

# vLLM's CPU attention takes head sizes that are multiples of 32: 2 heads of 32 (one KV head).
VLLM_TINY = (
    "tiny:qwen2?hidden_size=64&intermediate_size=128&num_layers=2&num_heads=2&num_kv_heads=1&initializer_range=0.2"
)
# A 32 MiB KV cache: on CPU vLLM would otherwise reserve gpu_memory_utilization of the host's memory.
ENGINE = VLLMConfig(kv_cache_memory_bytes=32 << 20, max_num_seqs=16, enforce_eager=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
NEW_TOKENS = 6


def vllm_agent(**overrides):
    kwargs = dict(
        model_name=VLLM_TINY, vllm_config=ENGINE, max_model_len=64, max_output_tokens=NEW_TOKENS, lr=5e-2, beta=0.0
    )
    kwargs.update(overrides)
    return make_agent(**kwargs)


def engine_greedy(agent, prompts=PROMPTS) -> list[list[int]]:
    """Sync the actor's weights into the engine, then its greedy completions."""
    agent.sync_engine_weights()
    return agent.engine.generate(
        prompts, max_tokens=NEW_TOKENS, temperature=0.0, stop_token_ids=sorted(agent.eos_token_ids())
    )


@torch.no_grad()
def hf_greedy(agent, prompts=PROMPTS) -> list[list[int]]:
    """Hugging Face greedy generation of the actor (LoRA on), one prompt at a time, same stop ids."""
    from agilerl.algorithms.core.adapters import ACTOR, use_adapter

    eos = sorted(agent.eos_token_ids())
    out = []
    was_training = agent.model.training
    agent.model.eval()
    try:
        with use_adapter(agent.model, ACTOR):
            for prompt in prompts:
                ids = torch.tensor([prompt])
                full = agent.model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    pad_token_id=agent.pad_token_id,
                    eos_token_id=eos,
                    synced_gpus=agent.sharded and agent.world_size > 1,
                )
                out.append(full[0, len(prompt) :].tolist())
    finally:
        agent.model.train(was_training)
    # Hugging Face pads a finished row; the engine returns it ragged, its stop token included.
    return [row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in out]


def learn_steps(agent, steps: int = 3) -> None:
    """A few updates on one rollout with spread rewards, enough to move the greedy completions."""
    ids, masks = agent.get_action(["1+1=", "2+2="])
    rewards = torch.arange(ids.shape[0], dtype=torch.float32) + 10 * agent.data_parallel_rank
    for _ in range(steps):
        agent.learn((ids, masks, rewards))
