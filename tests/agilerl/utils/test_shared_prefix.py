"""The shared-prefix forward: a group's prompt run once gives the one-pass forward's log-probs,
gradients and generations, on every model family it is enabled for, and falls back elsewhere."""

from __future__ import annotations

import pytest
import torch

from agilerl.utils.prefix_cache import prompt_groups, suffix_attention_mask
from agilerl.utils.shared_prefix import SHARED_PREFIX_MODEL_TYPES, shared_prefix_problem
from tests.agilerl.algorithms._common import make_agent, synthetic_experiences

SMALL = "hidden_size=32&intermediate_size=64&num_layers=2&initializer_range=0.1"
ARCH_EXTRA = {"qwen3_moe": "&moe_intermediate_size=32&num_experts=4&num_experts_per_tok=2"}


@pytest.fixture(autouse=True)
def _single_device(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def test_prompt_groups_find_the_distinct_prefixes_in_order():
    ids = torch.tensor([[5, 6, 7, 1], [5, 6, 8, 2], [9, 9, 7, 1], [5, 6, 3, 3], [9, 9, 4, 4]])
    mask = torch.ones_like(ids)
    groups = prompt_groups(ids, mask, 2)
    assert groups.rows.tolist() == [0, 2] and groups.inverse.tolist() == [0, 0, 1, 0, 1]
    # the mask is part of the prefix: a pad where another row has a token makes it distinct
    mask[3, 0] = 0
    assert prompt_groups(ids, mask, 2).rows.tolist() == [0, 2, 3]
    assert prompt_groups(ids, torch.ones_like(ids), 3) is None  # no two rows alike
    assert prompt_groups(ids, torch.ones_like(ids), 0) is None


def test_suffix_mask_is_causal_from_the_split_without_pad_keys():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    low = torch.finfo(torch.float32).min
    got = suffix_attention_mask(mask, 2, torch.float32)
    assert got.shape == (2, 1, 2, 4)
    allowed = got == 0
    assert allowed[0, 0].tolist() == [[False, True, True, False], [False, True, True, True]]
    assert allowed[1, 0].tolist() == [[True, True, True, False], [True, True, True, True]]
    assert got.min() == low
    assert suffix_attention_mask(torch.ones(3, 4, dtype=torch.long), 1, torch.float32).shape == (1, 1, 3, 4)


def test_the_rule_names_what_stops_it():
    assert shared_prefix_problem("qwen2", "sdpa", full_causal=True) is None
    assert "gemma3n" in shared_prefix_problem("gemma3n", "sdpa", full_causal=True)
    assert "flash" in shared_prefix_problem("qwen2", "flash_attention_2", full_causal=True)
    assert "sliding window" in shared_prefix_problem("mistral", "sdpa", full_causal=False)
    assert "tensor parallel" in shared_prefix_problem("llama", "eager", full_causal=True, tp=2)


def _two_ways(agent, ids, attention, first):
    """(one-pass, shared) log-probs and gradients of their masked sum; the passes' batch sizes."""
    sizes: list[tuple[int, int]] = []
    embed = agent.model.get_input_embeddings()
    hook = embed.register_forward_hook(lambda m, i, o: sizes.append(tuple(i[0].shape)))
    out = []
    try:
        for share in (False, True):
            agent.share_prompt_prefix = share
            agent.model.zero_grad(set_to_none=True)
            logp = agent.token_logprobs(ids, attention, first)
            logp[:, first:].sum().backward()
            out.append((logp.detach(), [p.grad.clone() for p in agent.trainable_params]))
    finally:
        hook.remove()
    return out, sizes


@pytest.mark.parametrize("arch", sorted(SHARED_PREFIX_MODEL_TYPES))
@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_prefix_logprobs_and_gradients_equal_the_one_pass_forward(arch, checkpointing):
    agent = make_agent(
        model_name=f"tiny:{arch}?{SMALL}{ARCH_EXTRA.get(arch, '')}", group_size=4, gradient_checkpointing=checkpointing
    )
    agent.learn(synthetic_experiences(agent, grouped=True)[:3])  # non-zero adapters
    ids, masks, _, _ = synthetic_experiences(agent, grouped=True, seed=1)
    attention = agent._attention_mask(ids, masks)
    first = agent._first_scored(masks[:, 1:])
    assert first == 4  # the last prompt column predicts the first completion token
    agent.model.train()
    ((full, full_grads), (shared, shared_grads)), sizes = _two_ways(agent, ids, attention, first)
    # one pass of 8 rows; then the 2 distinct prompts' 4 columns, and 8 rows of the other 7
    assert sizes == [(8, 11), (2, 4), (8, 7)], sizes
    scored = masks[:, 1:].bool()
    torch.testing.assert_close(shared[scored], full[scored], atol=2e-5, rtol=1e-5)
    assert shared[:, :first].abs().max() == 0
    for a, b in zip(shared_grads, full_grads):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    assert max(g.abs().max() for g in full_grads) > 1e-3  # the comparison means something


def test_shared_prefix_in_bf16_matches_within_bf16():
    agent = make_agent(dtype="bfloat16", group_size=4)
    ids, masks, _, _ = synthetic_experiences(agent, grouped=True, seed=1)
    attention = agent._attention_mask(ids, masks)
    first = agent._first_scored(masks[:, 1:])
    ((full, _), (shared, _)), _ = _two_ways(agent, ids, attention, first)
    scored = masks[:, 1:].bool()
    torch.testing.assert_close(shared[scored], full[scored], atol=0.05, rtol=0.02)


def test_falls_back_to_one_pass_where_rows_share_nothing_or_the_model_is_not_listed():
    agent = make_agent(group_size=4)
    ids, masks, _, _ = synthetic_experiences(agent, seed=1)  # every row random
    attention = agent._attention_mask(ids, masks)
    _, sizes = _two_ways(agent, ids, attention, agent._first_scored(masks[:, 1:]))
    assert sizes == [(8, 11), (8, 11)]
    gemma = make_agent(model_name=f"tiny:gemma2?{SMALL}", group_size=4)
    ids, masks, _, _ = synthetic_experiences(gemma, grouped=True, seed=1)
    _, sizes = _two_ways(gemma, ids, gemma._attention_mask(ids, masks), gemma._first_scored(masks[:, 1:]))
    assert sizes == [(8, 11), (8, 11)]


def test_learn_with_the_shared_prefix_gives_the_one_pass_update():
    from tests.agilerl.algorithms._common import lora_state

    updates = []
    for share in (False, True):
        agent = make_agent(group_size=4, share_prompt_prefix=share, micro_batch_size_per_gpu=4)
        metrics = agent.learn(synthetic_experiences(agent, grouped=True, seed=2)[:3])
        updates.append((metrics, lora_state(agent)))
    (m0, s0), (m1, s1) = updates
    assert abs(m0["loss"] - m1["loss"]) < 1e-6 and abs(m0["kl"] - m1["kl"]) < 1e-6
    for k in s0:
        torch.testing.assert_close(s1[k], s0[k], atol=1e-6, rtol=1e-5)


def test_generation_with_a_shared_prefill_gives_the_same_greedy_completions():
    from agilerl.algorithms.core.adapters import ACTOR

    outs, prefill = [], []
    for share in (False, True):
        agent = make_agent(group_size=4, share_prompt_prefix=share, max_output_tokens=6, seed=3)
        agent.learn(synthetic_experiences(agent, grouped=True)[:3])
        agent.generation_kwargs["do_sample"] = False
        embed = agent.model.get_input_embeddings()
        shapes: list[tuple[int, int]] = []
        hook = embed.register_forward_hook(lambda m, i, o, shapes=shapes: shapes.append(tuple(i[0].shape)))
        outs.append(agent.get_action(["1+2=", "13+4="]))
        hook.remove()
        prefill.append(shapes[0])
        assert ACTOR in agent.model.peft_config
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    # one pass: 8 rows of the padded 5-token prompt; shared: the 2 distinct prompts' first 4 columns
    assert prefill == [(8, 5), (2, 4)]
