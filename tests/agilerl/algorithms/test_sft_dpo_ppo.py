"""SFT, DPO and LLMPPO on one device: each loss against its published formula written out element
by element (values and gradients, with a control that the comparison can fail), each trainer's
update against a plain Hugging Face forward, checkpoints, populations and bad batches."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from agilerl.algorithms import DPO, LLMPPO, SFT
from agilerl.algorithms.core.pairs import BatchError
from agilerl.algorithms.dpo import dpo_loss
from agilerl.algorithms.ppo import gae_advantages, masked_whiten, ppo_loss, token_rewards
from agilerl.algorithms.sft import sft_loss
from tests.agilerl.algorithms._common import TINY, TOKENIZER, make_agent

PROMPTS = ["1+2=", "3+4=", "5+5=", "9+1="]
ANSWERS = ["3", "7", "0", "0"]
WRONG = ["5", "1", "9", "3"]


def _offline(algorithm, **overrides):
    from peft import LoraConfig

    kwargs = dict(
        pad_token_id=TOKENIZER.pad_token_id,
        pad_token=TOKENIZER.pad_token,
        tokenizer=TOKENIZER,
        lora_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM"),
        dtype="float32",
        device="cpu",
        gradient_checkpointing=False,
        lr=1e-2,
        logprob_chunk_size=7,
        seed=0,
    )
    kwargs.update(overrides)
    return algorithm(kwargs.pop("model_name", TINY), **kwargs)


def _hf_token_logprobs(model, ids, attention):
    """log p(ids[:, t+1] | ids[:, :t+1]) from the model's own full logits (no chunking, no tricks)."""
    logits = model(input_ids=ids, attention_mask=attention).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


# -- the losses against their formulas ----------------------------------------------------------
def test_sft_loss_is_the_token_mean_over_the_step():
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 5, generator=g) * 3).requires_grad_()
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 1], [0, 1, 0, 0, 0]])
    loss = sft_loss(logp, mask, total_tokens=6.0)
    terms = [-logp[i, t] for i in range(3) for t in range(5) if mask[i, t]]
    loop = sum(terms) / len(terms)
    torch.testing.assert_close(loss, loop)
    (g1,) = torch.autograd.grad(loss, logp)
    (g2,) = torch.autograd.grad(loop, logp)
    torch.testing.assert_close(g1, g2)
    # Control: the mean of per-sequence means weighs a one-token row like a three-token one.
    per_sequence = sum(-(logp[i] * mask[i]).sum() / mask[i].sum() for i in range(3)) / 3
    assert not torch.allclose(per_sequence, loop)


def test_dpo_loss_is_its_formula():
    g = torch.Generator().manual_seed(1)
    c, r = (-torch.rand(4, generator=g) * 20).requires_grad_(), (-torch.rand(4, generator=g) * 20).requires_grad_()
    c_ref, r_ref = c.detach() + torch.randn(4, generator=g), r.detach() + torch.randn(4, generator=g)
    loss, stats = dpo_loss(c, r, c_ref, r_ref, beta=0.1, num_pairs=4)
    loop = sum(-F.logsigmoid(0.1 * ((c[i] - c_ref[i]) - (r[i] - r_ref[i]))) for i in range(4)) / 4
    torch.testing.assert_close(loss, loop)
    grads = torch.autograd.grad(loss, (c, r))
    for ours, theirs in zip(grads, torch.autograd.grad(loop, (c, r))):
        torch.testing.assert_close(ours, theirs)
    wins = sum(float(c[i].detach() - c_ref[i]) > float(r[i].detach() - r_ref[i]) for i in range(4))
    assert float(stats["accuracy"]) == wins
    # Control: swapping chosen and rejected is another objective.
    assert not torch.allclose(dpo_loss(r, c, r_ref, c_ref, beta=0.1, num_pairs=4)[0], loss)


def _gae_loop(rewards, values, mask, gamma, lam):
    """GAE written out per sequence over its completion tokens, V = 0 past the end."""
    n, length = rewards.shape
    adv = torch.zeros(n, length)
    for i in range(n):
        tokens = [t for t in range(length) if mask[i, t]]
        running = 0.0
        for k in reversed(range(len(tokens))):
            t = tokens[k]
            nxt = float(values[i, tokens[k + 1]]) if k + 1 < len(tokens) else 0.0
            delta = float(rewards[i, t]) + gamma * nxt - float(values[i, t])
            running = delta + gamma * lam * running
            adv[i, t] = running
    return adv


def test_token_rewards_and_gae_are_their_formulas():
    g = torch.Generator().manual_seed(2)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1], [0, 0, 1, 0, 0, 0]], dtype=torch.float32)
    old, ref = -torch.rand(3, 6, generator=g), -torch.rand(3, 6, generator=g)
    rewards = torch.tensor([1.0, -0.5, 2.0])
    per_token, kl = token_rewards(old, ref, rewards, mask, beta=0.05)
    for i, last in enumerate((4, 5, 2)):
        for t in range(6):
            want = (-0.05 * float(old[i, t] - ref[i, t]) + (float(rewards[i]) if t == last else 0.0)) * float(
                mask[i, t]
            )
            assert math.isclose(float(per_token[i, t]), want, rel_tol=1e-6, abs_tol=1e-7), (i, t)
    values = torch.randn(3, 6, generator=g)
    for gamma, lam in ((1.0, 0.95), (0.9, 0.5)):
        adv, returns = gae_advantages(per_token, values, mask, gamma=gamma, lam=lam)
        loop = _gae_loop(per_token, values, mask, gamma, lam)
        torch.testing.assert_close(adv * mask, loop)
        torch.testing.assert_close(returns * mask, (loop + values) * mask)
    # Control: lambda = 1 (Monte-Carlo returns less V) is another estimate.
    assert not torch.allclose(
        gae_advantages(per_token, values, mask, gamma=1.0, lam=1.0)[0] * mask,
        _gae_loop(per_token, values, mask, 1.0, 0.95),
    )
    whitened = masked_whiten(adv, mask)
    picked = whitened[mask.bool()]
    assert abs(float(picked.mean())) < 1e-5 and math.isclose(float(picked.std()), 1.0, rel_tol=1e-4)


def test_ppo_loss_is_its_formula():
    g = torch.Generator().manual_seed(3)
    n, length = 3, 5
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.float32)
    logp = (-torch.rand(n, length, generator=g)).requires_grad_()
    old = logp.detach() + torch.randn(n, length, generator=g) * 0.5
    adv = torch.randn(n, length, generator=g)
    values = torch.randn(n, length, generator=g).requires_grad_()
    old_values = values.detach() + torch.randn(n, length, generator=g) * 0.5
    returns = torch.randn(n, length, generator=g)
    loss, stats = ppo_loss(
        logp, old, adv, values, old_values, returns, mask, clip_coef=0.2, clip_coef_value=0.2, vf_coef=0.1
    )
    pg_terms, vf_terms = [], []
    for i in range(n):
        for t in range(length):
            if not mask[i, t]:
                continue
            ratio = torch.exp(logp[i, t] - old[i, t])
            pg_terms.append(torch.max(-adv[i, t] * ratio, -adv[i, t] * torch.clamp(ratio, 0.8, 1.2)))
            clipped = old_values[i, t] + torch.clamp(values[i, t] - old_values[i, t], -0.2, 0.2)
            vf_terms.append(torch.max((values[i, t] - returns[i, t]) ** 2, (clipped - returns[i, t]) ** 2))
    loop = sum(pg_terms) / len(pg_terms) + 0.1 * 0.5 * sum(vf_terms) / len(vf_terms)
    torch.testing.assert_close(loss, loop)
    for ours, theirs in zip(torch.autograd.grad(loss, (logp, values)), torch.autograd.grad(loop, (logp, values))):
        torch.testing.assert_close(ours, theirs)
    assert 0 < float(stats["clip_fraction"]) < 1 and 0 < float(stats["value_clip_fraction"]) < 1
    # Control: without the value clip the value loss differs.
    unclipped, _ = ppo_loss(
        logp, old, adv, values, old_values, returns, mask, clip_coef=0.2, clip_coef_value=100.0, vf_coef=0.1
    )
    assert not torch.allclose(unclipped, loss)


# -- the trainers against a plain forward ---------------------------------------------------------
@pytest.mark.parametrize("full", [False, True])
def test_sft_learns_the_completion_only_as_a_plain_forward_says(full):
    agent = _offline(SFT, batch_size=4, micro_batch_size_per_gpu=2, **({"lora_config": None} if full else {}))
    batch = agent.encode(PROMPTS, ANSWERS)
    ids, attention, completion = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    with torch.no_grad():
        logp = _hf_token_logprobs(agent.model, ids, attention)
    mask = completion[:, 1:].float()
    expected = float(-(logp * mask).sum() / mask.sum())
    before = {n: p.detach().clone() for n, p in agent.model.named_parameters()}
    metrics = agent.learn(batch)
    assert math.isclose(metrics["loss"], expected, rel_tol=1e-5), (metrics, expected)
    assert metrics["completion_tokens"] == float(mask.sum()) == 8  # one digit and the EOS per example
    changed = [n for n, p in agent.model.named_parameters() if not torch.equal(before[n], p)]
    if full:
        assert any("embed_tokens" in n for n in changed) and any("norm" in n for n in changed)
    else:
        assert changed and all(".lora_" in n for n in changed)
    losses = [agent.learn(batch)["loss"] for _ in range(3)]
    assert losses[-1] < metrics["loss"]
    # The same batch in upstream AgileRL's layout (right-padded, prompt_lengths) is the same batch.
    fresh = _offline(SFT, batch_size=4, **({"lora_config": None} if full else {}))
    upstream = _right_padded(ids, attention, completion)
    assert math.isclose(fresh.learn(upstream)["loss"], expected, rel_tol=1e-5)


def _right_padded(ids, attention, completion):
    """The trainer's left-padded rows moved to the left edge, with the prompt lengths."""
    out_ids, out_att, lengths = torch.full_like(ids, TOKENIZER.pad_token_id), torch.zeros_like(attention), []
    for i in range(ids.shape[0]):
        real = ids[i][attention[i].bool()]
        out_ids[i, : real.numel()] = real
        out_att[i, : real.numel()] = 1
        lengths.append(int((attention[i].bool() & ~completion[i].bool()).sum()))
    return {"input_ids": out_ids, "attention_mask": out_att, "prompt_lengths": torch.tensor(lengths)}


@pytest.mark.parametrize("full", [False, True])
def test_dpo_learns_against_its_reference_as_a_plain_forward_says(full):
    agent = _offline(DPO, batch_size=2, micro_batch_size_per_gpu=2, beta=0.5, **({"lora_config": None} if full else {}))
    assert (agent.reference_model is not None) == full
    batch = agent.encode(PROMPTS[:2], ANSWERS[:2], WRONG[:2])
    with torch.no_grad():
        seqs = {}
        for side in ("chosen", "rejected"):
            logp = _hf_token_logprobs(agent.model, batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"])
            seqs[side] = (logp * batch[f"{side}_completion_mask"][:, 1:]).sum(dim=1)
    metrics = agent.learn(batch)
    # the policy starts as its reference: every implicit reward is 0, the loss log 2
    assert math.isclose(metrics["loss"], math.log(2), rel_tol=1e-6) and metrics["reward_margin"] == 0.0
    second = agent.learn(batch)
    assert second["loss"] < math.log(2) and second["reward_margin"] > 0 and second["reward_accuracy"] == 1.0
    # The implicit rewards are beta times the change of each sequence's summed log-prob.
    with torch.no_grad():
        now = {
            side: (
                _hf_token_logprobs(agent.model, batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"])
                * batch[f"{side}_completion_mask"][:, 1:]
            ).sum(dim=1)
            for side in ("chosen", "rejected")
        }
    third = agent.learn(batch)
    want = float(0.5 * (now["chosen"] - seqs["chosen"]).mean())
    assert math.isclose(third["chosen_reward"], want, rel_tol=1e-4), (third, want)


def test_ppo_learns_with_a_value_head_and_checkpoints_it(tmp_path):
    agent = make_agent(algorithm=LLMPPO, group_size=1, batch_size=4, micro_batch_size_per_gpu=2, update_epochs=2)
    assert agent.group_size == 1 and agent.vf_coef == 0.1 and agent.gae_lambda == 0.95
    head = agent.value_head.weight.detach().clone()
    ids, masks = agent.get_action(PROMPTS)
    metrics = agent.learn((ids, masks, torch.tensor([1.0, 0.0, 0.5, 0.2])))
    assert all(math.isfinite(metrics[k]) for k in ("loss", "policy_loss", "value_loss", "kl"))
    assert metrics["value_loss"] > 0 and not torch.equal(agent.value_head.weight, head)
    agent.save_checkpoint(tmp_path / "ppo")
    again = make_agent(algorithm=LLMPPO, group_size=1, batch_size=4, micro_batch_size_per_gpu=2, update_epochs=2)
    again.load_checkpoint(tmp_path / "ppo")
    assert torch.equal(again.value_head.weight, agent.value_head.weight) and again.steps == 1
    # the head's AdamW state came back too: the next step is the same
    ids, masks = agent.get_action(PROMPTS)
    torch.manual_seed(5)
    a = agent.learn((ids, masks, torch.ones(4)))
    torch.manual_seed(5)
    b = again.learn((ids, masks, torch.ones(4)))
    assert math.isclose(a["loss"], b["loss"], rel_tol=1e-6) and torch.equal(
        again.value_head.weight, agent.value_head.weight
    )


def test_ppo_values_read_the_final_hidden_state_at_each_scored_position():
    agent = make_agent(algorithm=LLMPPO, group_size=1, batch_size=2, share_prompt_prefix=False)
    ids, masks = agent.get_action(PROMPTS[:2])
    attention = agent._attention_mask(ids, masks)
    first = agent._first_scored(masks[:, 1:])
    with torch.no_grad():
        _, values = agent._logprobs_and_values(ids, attention, first)
        out = agent.model(input_ids=ids, attention_mask=attention, output_hidden_states=True)
        want = agent.value_head(out.hidden_states[-1][:, :-1].float()).squeeze(-1)
    torch.testing.assert_close(values[:, first:], want[:, first:], rtol=1e-5, atol=1e-6)
    assert torch.equal(values[:, :first], torch.zeros_like(values[:, :first]))


# -- full fine-tuning ---------------------------------------------------------------------------
def test_full_finetuning_of_a_bf16_model_keeps_fp32_masters_gradients_and_moments():
    from agilerl.distributed import MasterWeightAdamW

    agent = _offline(SFT, lora_config=None, dtype="bfloat16", batch_size=4, micro_batch_size_per_gpu=2, lr=1e-3)
    assert isinstance(agent.optimizer, MasterWeightAdamW)
    assert all(p.dtype == torch.bfloat16 for p in agent.model.parameters())
    batch = agent.encode(PROMPTS, ANSWERS)
    # The fp32 gradient accumulated over two micro-batches is the gradient of the whole batch.
    agent.micro_batch_size_per_gpu = 2
    masters = [m for _, m in agent.optimizer.masters]
    captured = {}
    real_step = agent.optimizer.step

    def keep_grads():
        captured["g"] = [m.grad.clone() for m in masters]
        return real_step()

    agent.optimizer.step = keep_grads
    agent.learn(batch)
    assert all(g.dtype == torch.float32 for g in captured["g"])
    assert all(p.grad is None for p in agent.model.parameters())  # the bf16 gradients were freed into the masters
    whole = _offline(SFT, lora_config=None, dtype="bfloat16", batch_size=4, lr=1e-3)
    whole.optimizer.step = lambda: captured.__setitem__("whole", [m.grad.clone() for _, m in whole.optimizer.masters])
    whole.learn(batch)
    for a, b in zip(captured["g"], captured["whole"]):
        torch.testing.assert_close(a, b, rtol=0.05, atol=2e-3)  # bf16 forwards of 2 rows vs 4
    # An update far below bf16's resolution still moves the fp32 master, not the bf16 weight.
    tiny = _offline(SFT, lora_config=None, dtype="bfloat16", batch_size=4, lr=1e-9)
    before = [m.clone() for _, m in tiny.optimizer.masters]
    weights = [p.detach().clone() for p in tiny.model.parameters()]
    tiny.learn(batch)
    assert any(not torch.equal(m, b) for (_, m), b in zip(tiny.optimizer.masters, before))
    # (weights of any size: a zero bias moves by 1e-9, which bf16 represents)
    assert all(torch.equal(p[w.abs() > 1e-3], w[w.abs() > 1e-3]) for p, w in zip(tiny.model.parameters(), weights))


def test_full_finetuning_checkpoints_every_weight_and_the_fp32_masters(tmp_path):
    agent = _offline(DPO, lora_config=None, dtype="bfloat16", batch_size=2, lr=1e-3)
    batch = agent.encode(PROMPTS[:2], ANSWERS[:2], WRONG[:2])
    agent.learn(batch)
    agent.save_checkpoint(tmp_path / "full")
    payload = torch.load(tmp_path / "full" / "attributes.pt", weights_only=False)
    assert payload["full_finetune"] and set(payload["weights"]) == {"model"}  # the reference never moved
    again = _offline(DPO, lora_config=None, dtype="bfloat16", batch_size=2, lr=1e-3)
    again.load_checkpoint(tmp_path / "full")
    for (_, a), (_, b) in zip(agent.optimizer.masters, again.optimizer.masters):
        assert torch.equal(a, b)  # the fp32 masters, not their bf16 rounding
    assert math.isclose(again.learn(batch)["loss"], agent.learn(batch)["loss"], rel_tol=1e-6)
    with pytest.raises(ValueError, match="full fine-tuning checkpoint"):
        _offline(DPO, batch_size=2).load_checkpoint(tmp_path / "full")
    agent.update_reference()
    agent.save_checkpoint(tmp_path / "moved")
    assert set(torch.load(tmp_path / "moved" / "attributes.pt", weights_only=False)["weights"]) == {
        "model",
        "reference",
    }


def test_full_finetuning_grpo_refers_to_a_frozen_copy_of_the_initial_model():
    agent = make_agent(lora_config=None, beta=0.1, update_epochs=2)
    ref = agent.reference_model
    assert ref is not None and not any(p.requires_grad for p in ref.parameters())
    for (_, a), (_, b) in zip(agent.model.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b)
    from tests.agilerl.algorithms._common import synthetic_experiences

    metrics = agent.learn(synthetic_experiences(agent)[:3])
    assert metrics["kl"] > 0  # the second epoch's policy has moved away from the frozen copy
    assert any(not torch.equal(a, b) for a, b in zip(agent.model.parameters(), ref.parameters()))
    assert make_agent(lora_config=None, beta=0.0).reference_model is None


# -- populations and bad input -------------------------------------------------------------------
def test_populations_of_the_offline_algorithms_differ_by_seed():
    pop = SFT.population(
        2,
        model_name=TINY,
        pad_token_id=TOKENIZER.pad_token_id,
        pad_token=TOKENIZER.pad_token,
        tokenizer=TOKENIZER,
        dtype="float32",
        device="cpu",
        batch_size=4,
        seed=3,
        gradient_checkpointing=False,
        logprob_chunk_size=None,
    )
    assert [a.index for a in pop] == [0, 1] and [a.seed for a in pop] == [3, 4]
    batch = pop[0].encode(PROMPTS, ANSWERS)
    a, b = (agent.learn(batch) for agent in pop)
    assert a["loss"] == b["loss"]  # the same base: the adapters start as the identity
    lora = [{n: p for n, p in agent.model.named_parameters() if "lora_A" in n} for agent in pop]
    assert any(not torch.equal(lora[0][n], lora[1][n]) for n in lora[0])  # adapters drawn from their own seeds


def test_pairs_over_max_model_len_keep_the_prompts_end_and_the_completions_start():
    """One character is one token here: a 10-token prompt and a 6-token completion with its EOS
    make a batch 17 wide; under max_model_len=12 prompts keep their last max(12 - 7, 12 // 2) = 6
    tokens and completions their first 12 - 6 = 6 (so no EOS: it did not end there)."""
    eos, three = TOKENIZER.eos_token_id, TOKENIZER.convert_tokens_to_ids("3")

    def parts(batch, side=""):
        """Row by row: (the prompt's text, the completion's token ids)."""
        ids, att, comp = (batch[f"{side}{k}"] for k in ("input_ids", "attention_mask", "completion_mask"))
        return [
            (TOKENIZER.decode(row[(a & ~c).bool()].tolist()), row[c.bool()].tolist())
            for row, a, c in zip(ids, att, comp)
        ]

    def chars(text):
        return TOKENIZER.convert_tokens_to_ids(list(text))

    sft = _offline(SFT, batch_size=2, max_model_len=12)
    batch = sft.encode(["0123456789", "1+2="], ["123456", "3"])
    assert parts(batch) == [("456789", chars("123456")), ("1+2=", [three, eos])]  # the second fits as it was
    assert math.isfinite(sft.learn(batch)["loss"])
    with pytest.raises(BatchError, match="the batch is 17 tokens wide .*, over max_model_len=12"):
        sft.learn(_offline(SFT, batch_size=2).encode(["0123456789", "1+2="], ["123456", "3"]))
    # Width is the longest prompt plus the longest completion: a row's own length is not enough.
    # Prompts of 10 and 8, completions of 1 and 8 (+ EOS): each row fits in 12, the batch (19) does not.
    wide = sft.encode(["0123456789", "98765432"], ["1", "12345678"])
    assert wide["input_ids"].shape[1] == 12
    assert parts(wide) == [("456789", chars("1") + [eos]), ("765432", chars("123456"))]

    # A preference pair keeps one prompt for both sides, cut for its longer completion (8 + EOS).
    dpo = _offline(DPO, batch_size=2, max_model_len=12)
    pairs = dpo.encode(["0123456789", "1+2="], ["12345678", "3"], ["9", "4"])
    assert parts(pairs, "chosen_")[0] == ("456789", chars("123456"))
    assert parts(pairs, "rejected_")[0] == ("456789", chars("9") + [eos])
    assert math.isfinite(dpo.learn(pairs)["loss"])


def test_a_batch_without_the_fields_an_objective_needs_is_one_clear_error():
    sft = _offline(SFT, batch_size=4)
    batch = sft.encode(PROMPTS, ANSWERS)
    with pytest.raises(BatchError, match="'completion_mask' .* or 'prompt_lengths'"):
        sft.learn({"input_ids": batch["input_ids"]})
    with pytest.raises(BatchError, match="no 'input_ids'"):
        sft.learn({"ids": batch["input_ids"]})
    # upstream's right-padded layout without its attention mask: the padding would be learnt
    with pytest.raises(BatchError, match="'prompt_lengths' needs attention_mask too"):
        sft.learn({"input_ids": batch["input_ids"], "prompt_lengths": torch.full((4,), 4)})
    with pytest.raises(ValueError, match="got 2 examples; a rank's share of batch_size=4"):
        sft.learn({k: v[:2] for k, v in batch.items()})
    dpo = _offline(DPO, batch_size=2)
    pairs = dpo.encode(PROMPTS[:2], ANSWERS[:2], WRONG[:2])
    with pytest.raises(BatchError, match="no 'rejected_input_ids' .* a chosen and a rejected completion"):
        dpo.learn({k: v for k, v in pairs.items() if not k.startswith("rejected")})
    with pytest.raises(ValueError, match="must be even"):
        _offline(DPO, batch_size=2, micro_batch_size_per_gpu=1)
    with pytest.raises(BatchError, match="3 chosen but 2 rejected"):
        dpo.encode(PROMPTS[:3], ANSWERS[:3], WRONG[:2])
    with pytest.raises(ValueError, match="use_separate_reference_adapter needs LoRA"):
        _offline(DPO, lora_config=None, use_separate_reference_adapter=True)
    with pytest.raises(ValueError, match="load_in_4bit .* give a lora_config"):
        _offline(SFT, lora_config=None, load_in_4bit=True)
    with pytest.raises(ValueError, match="lora_config must be a peft LoraConfig"):
        _offline(SFT, lora_config="all-linear")
    with pytest.raises(ValueError, match="gae_lambda must be in"):
        make_agent(algorithm=LLMPPO, gae_lambda=1.5)
    with pytest.raises(ValueError, match="beta must be a finite number >= 0, got inf"):
        _offline(DPO, beta=math.inf)
    with pytest.raises(ValueError, match=r"beta must be > 0 \(the implicit reward's scale\)"):
        _offline(DPO, beta=0.0)
    with pytest.raises(ValueError, match="nll_alpha must be a finite number >= 0, got nan"):
        _offline(DPO, nll_alpha=math.nan)


def test_manifests_train_sft_dpo_and_ppo_and_full_finetuning():
    from agilerl.manifest import ManifestError, load_manifest
    from agilerl.train import train

    section = {"model_name": TINY, "dtype": "float32", "gradient_checkpointing": False, "logprob_chunk_size": None}
    for name, lora in (("SFT", None), ("DPO", {"r": 2, "alpha": 4, "dropout": 0.0}), ("LLMPPO", None)):
        extra = {"max_output_tokens": 2, "gather_weights_for_rollout": False} if name == "LLMPPO" else {}
        manifest = load_manifest(
            {
                "algorithm": {"name": name, **section, **extra},
                "training": {"rollout_batch_size": 2, "max_steps": 2},
                "lora": lora,
            }
        )
        assert (manifest.lora is None) == (lora is None)
        history = train(manifest, device="cpu")[0]
        assert len(history) == 2 and all(math.isfinite(m["loss"]) for m in history), name
        if name == "DPO":
            assert history[0]["reward_margin"] == 0.0  # the policy starts as its reference
    with pytest.raises(ManifestError, match="group_size: SFT learns from the environment's answers"):
        load_manifest({"algorithm": {"name": "SFT", "model_name": "x", "group_size": 4}})
    with pytest.raises(ManifestError, match="vf_coef: DPO takes beta, nll_alpha"):
        load_manifest({"algorithm": {"name": "DPO", "model_name": "x", "vf_coef": 0.5}})
    with pytest.raises(ManifestError, match="DPO runs a pair's chosen and rejected"):
        load_manifest(
            {
                "algorithm": {"name": "DPO", "model_name": "x", "micro_batch_size_per_gpu": 1},
                "training": {"rollout_batch_size": 2},
            }
        )
    with pytest.raises(ManifestError, match="4-bit weights do not train"):
        load_manifest({"algorithm": {"name": "SFT", "model_name": "x", "load_in_4bit": True}, "lora": None})
    with pytest.raises(ManifestError, match="DPO's beta scales its implicit reward"):
        load_manifest({"algorithm": {"name": "DPO", "model_name": "x", "beta": 0.0}})
    with pytest.raises(ManifestError, match="SFT has no reference policy"):
        load_manifest({"algorithm": {"name": "SFT", "model_name": "x", "use_separate_reference_adapter": True}})
    with pytest.raises(ManifestError, match="a vLLM engine there is not supported yet"):
        load_manifest({"algorithm": {"model_name": "x", "vllm": {}}, "training": {"rollout_engines_per_agent": 1}})
    with pytest.raises(ManifestError, match="tensor-parallel group"):
        load_manifest(
            {"algorithm": {"model_name": "x", "fsdp": {"tp": 2}}, "training": {"rollout_engines_per_agent": 1}}
        )


def test_a_full_finetuning_checkpoint_of_another_model_is_refused(tmp_path):
    agent = _offline(SFT, lora_config=None, batch_size=4)
    agent.save_checkpoint(tmp_path / "small")
    other = _offline(
        SFT,
        lora_config=None,
        batch_size=4,
        model_name="tiny:qwen2?hidden_size=32&intermediate_size=64&num_layers=3&initializer_range=0.1",
    )
    with pytest.raises(ValueError, match="another model's weights: missing .*layers.2"):
        other.load_checkpoint(tmp_path / "small")


@pytest.mark.parametrize("algorithm", [SFT, DPO])
def test_encoded_completions_end_with_the_tokenizers_end_of_sequence_id_where_the_model_lists_it(algorithm):
    """Llama-3.1-Instruct's generation_config lists <|end_of_text|>, <|eom_id|>, <|eot_id|>; its
    tokenizer's eos_token is <|eot_id|>, the end of its chat turns: completions end with that."""
    agent = _offline(algorithm, batch_size=4)
    own = TOKENIZER.eos_token_id

    def ends():
        if algorithm is SFT:
            batch, sides = agent.encode(PROMPTS, ANSWERS), ("",)
        else:
            batch, sides = agent.encode(PROMPTS, ANSWERS, ANSWERS[::-1]), ("chosen_", "rejected_")
        return {
            int(row[m.bool()][-1])
            for side in sides
            for row, m in zip(batch[f"{side}input_ids"], batch[f"{side}completion_mask"])
        }

    agent.eos_token_id = [3, 5, own]
    assert ends() == {own}
    agent.eos_token_id = [5, 3]  # the tokenizer's is not among them: the model's first, not the smallest
    assert ends() == {5}
