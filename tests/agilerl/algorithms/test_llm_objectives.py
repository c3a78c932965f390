"""CISPO, GSPO and LLMREINFORCE: each loss against its published formula written out element by
element (values and gradients), and each algorithm training on GRPO's loop."""

from __future__ import annotations

import math

import pytest
import torch

from agilerl.algorithms import CISPO, GRPO, GSPO, LLMREINFORCE
from agilerl.algorithms.cispo import cispo_loss
from agilerl.algorithms.grpo import grpo_loss
from agilerl.algorithms.gspo import gspo_loss
from agilerl.algorithms.reinforce import leave_one_out_advantages, reinforce_loss
from tests.agilerl.algorithms._common import make_agent, synthetic_experiences


def _inputs(seed=0, n=4, T=5):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(n, T, generator=g) * 3).requires_grad_()
    old = logp.detach() + torch.randn(n, T, generator=g) * 0.8  # off-policy: ratios far from 1
    ref = logp.detach() + torch.randn(n, T, generator=g) * 0.3
    adv = torch.randn(n, generator=g)
    mask = torch.ones(n, T)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    return logp, old, ref, adv, mask


def _k3(ref, lp):
    return math.exp(ref - lp) - (ref - lp) - 1.0


def _cispo_loop(logp, old, ref, adv, mask, high, beta):
    """MiniMax-M1 eq. 4, with the token-level normalisation 1 / sum |o_i|."""
    total, count = 0, 0
    for i in range(len(logp)):
        for t in range(len(logp[i])):
            if mask[i][t]:
                r = math.exp(float(logp[i][t].detach()) - float(old[i][t]))
                w = min(r, 1.0 + high)  # a number: the stop-gradient
                total = (
                    total
                    - w * float(adv[i]) * logp[i][t]
                    + beta * (torch.exp(ref[i][t] - logp[i][t]) - (ref[i][t] - logp[i][t]) - 1.0)
                )
                count += 1
    return total / count


def _gspo_loop(logp, old, ref, adv, mask, low, high, beta):
    """GSPO eq. 5-7: the length-normalised sequence ratio, clipped, averaged over sequences."""
    out = 0
    for i in range(len(logp)):
        tokens = [t for t in range(len(logp[i])) if mask[i][t]]
        s = torch.exp(sum(logp[i][t] - old[i][t] for t in tokens) / len(tokens))
        a = float(adv[i])
        term = -torch.min(s * a, torch.clamp(s, 1 - low, 1 + high) * a)
        kl = sum(torch.exp(ref[i][t] - logp[i][t]) - (ref[i][t] - logp[i][t]) - 1.0 for t in tokens) / len(tokens)
        out = out + term + beta * kl
    return out / len(logp)


def _reinforce_loop(logp, ref, rewards, group, mask, beta):
    """REINFORCE with the leave-one-out baseline (RLOO): -(r_i - mean of the others) * log pi(o_i)."""
    out = 0
    n = len(logp)
    for i in range(n):
        g = i // group
        others = [float(rewards[j]) for j in range(g * group, (g + 1) * group) if j != i]
        a = float(rewards[i]) - sum(others) / len(others)
        tokens = [t for t in range(len(logp[i])) if mask[i][t]]
        seq = sum(logp[i][t] for t in tokens)
        kl = sum(torch.exp(ref[i][t] - logp[i][t]) - (ref[i][t] - logp[i][t]) - 1.0 for t in tokens) / len(tokens)
        out = out - a * seq + beta * kl
    return out / n


def _value_and_grad(fn, logp):
    loss = fn()
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_cispo_loss_is_its_formula_and_stops_the_weights_gradient(beta):
    logp, old, ref, adv, mask = _inputs()
    ours = _value_and_grad(lambda: cispo_loss(logp, old, ref, adv, mask, clip_coef_high=0.5, beta=beta)[0], logp)
    loop = _value_and_grad(lambda: _cispo_loop(logp, old, ref, adv, mask, 0.5, beta), logp)
    torch.testing.assert_close(ours, loop)
    _, stats = cispo_loss(logp, old, ref, adv, mask, clip_coef_high=0.5, beta=beta)
    assert 0 < stats["clip_fraction"] < 1  # some weights truncated, so the cap is exercised
    # Control: a weight that kept its gradient (no stop-gradient) gives another gradient.
    through = _value_and_grad(
        lambda: (-(torch.clamp(torch.exp(logp - old), max=1.5) * adv[:, None] * logp) * mask).sum() / mask.sum(), logp
    )
    assert not torch.allclose(
        through[1],
        _value_and_grad(lambda: cispo_loss(logp, old, None, adv, mask, clip_coef_high=0.5, beta=0.0)[0], logp)[1],
    )


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_gspo_loss_is_its_formula(beta):
    logp, old, ref, adv, mask = _inputs(seed=1)
    old = logp.detach() + (old - logp.detach()) * 0.15  # sequence ratios straddling a clip range of 0.03/0.04
    ours = _value_and_grad(
        lambda: gspo_loss(logp, old, ref, adv, mask, clip_coef=0.03, clip_coef_high=0.04, beta=beta)[0], logp
    )
    loop = _value_and_grad(lambda: _gspo_loop(logp, old, ref, adv, mask, 0.03, 0.04, beta), logp)
    torch.testing.assert_close(ours, loop)
    _, stats = gspo_loss(logp, old, ref, adv, mask, clip_coef=0.03, clip_coef_high=0.04, beta=beta)
    assert 0 < stats["clip_fraction"] < 1
    # Control: GRPO's token-level ratio on the same inputs is another objective.
    grpo = _value_and_grad(lambda: grpo_loss(logp, old, ref, adv, mask, clip_coef=0.03, beta=beta)[0], logp)
    assert not torch.allclose(grpo[1], ours[1])


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_reinforce_loss_and_leave_one_out_baseline_are_their_formula(beta):
    logp, _, ref, _, mask = _inputs(seed=2)
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0])
    adv = leave_one_out_advantages(rewards, group_size=2)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, -1.5, 1.5]))  # r_i - r_(other)
    ours = _value_and_grad(lambda: reinforce_loss(logp, ref, adv, mask, beta=beta)[0], logp)
    loop = _value_and_grad(lambda: _reinforce_loop(logp, ref, rewards, 2, mask, beta), logp)
    torch.testing.assert_close(ours, loop)
    # Control: GRPO's normalised advantages are not the leave-one-out ones.
    from agilerl.algorithms.grpo import group_advantages

    assert not torch.allclose(group_advantages(rewards, 2), adv)


def test_defaults_follow_each_paper_and_bad_combinations_are_refused():
    with pytest.raises(ValueError, match="clip_coef_high"):
        make_agent(algorithm=CISPO, clip_coef=0.2)
    with pytest.raises(ValueError, match="on-policy"):
        make_agent(algorithm=LLMREINFORCE, update_epochs=2)
    with pytest.raises(ValueError, match="drop clip_coef"):
        make_agent(algorithm=LLMREINFORCE, clip_coef=0.2)
    import inspect

    assert inspect.signature(CISPO).parameters["beta"].default == 0.0
    assert inspect.signature(CISPO).parameters["clip_coef_high"].default == 4.0
    sig = inspect.signature(GSPO).parameters
    assert (sig["beta"].default, sig["clip_coef"].default, sig["clip_coef_high"].default) == (0.0, 3e-4, 4e-4)


@pytest.mark.parametrize("algorithm", [CISPO, GSPO, LLMREINFORCE])
def test_each_algorithm_learns_on_grpos_loop_and_checkpoints_under_its_own_name(algorithm, tmp_path):
    extra = {} if algorithm is LLMREINFORCE else {"update_epochs": 2}  # a second epoch: ratios off 1
    agent = make_agent(algorithm=algorithm, **extra)
    before = {n: p.detach().clone() for n, p in agent.model.named_parameters() if p.requires_grad}
    ids, masks, rewards, _ = synthetic_experiences(agent)
    metrics = agent.learn((ids, masks, rewards))
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    after = dict(agent.model.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)
    agent.save_checkpoint(tmp_path / "ckpt")
    same = make_agent(algorithm=algorithm, **extra)
    same.load_checkpoint(tmp_path / "ckpt")
    assert same.steps == 1
    with pytest.raises(ValueError, match=f"is a {algorithm.algo_name} checkpoint, not GRPO"):
        make_agent(algorithm=GRPO).load_checkpoint(tmp_path / "ckpt")


def test_a_manifest_trains_cispo_with_its_own_defaults():
    from agilerl.manifest import ManifestError, load_manifest
    from agilerl.train import train
    from tests.agilerl.algorithms._common import TINY

    section = {
        "name": "CISPO",
        "model_name": TINY,
        "group_size": 2,
        "max_output_tokens": 2,
        "dtype": "float32",
        "max_model_len": 8,
        "gradient_checkpointing": False,
        "logprob_chunk_size": None,
        "gather_weights_for_rollout": False,
    }
    manifest = load_manifest(
        {
            "algorithm": section,
            "training": {"rollout_batch_size": 2, "max_steps": 1},
            "lora": {"r": 2, "alpha": 4, "dropout": 0.0},
        }
    )
    assert manifest.algorithm.algorithm_kwargs() == {"group_size": 2}  # CISPO's own beta and cap
    history = train(manifest, device="cpu")
    assert len(history[0]) == 1 and history[0][0]["kl"] == 0.0  # beta 0: no KL term
    with pytest.raises(ManifestError, match="'GRPO', 'CISPO', 'GSPO', 'LLMREINFORCE', 'LLMPPO', 'SFT' or 'DPO'"):
        load_manifest({"algorithm": {**section, "name": "PPO"}})
    with pytest.raises(ManifestError, match="clip_coef: CISPO takes beta, clip_coef_high"):
        load_manifest({"algorithm": {**section, "clip_coef": 0.2}})


def test_the_manifest_and_the_planner_know_each_algorithms_own_defaults():
    # Three torch-free places describe the algorithms (the trainer classes, the manifest's
    # validation, the planner's Workload): they must agree with the classes' signatures.
    import inspect

    from agilerl.algorithms import DPO, LLMPPO, SFT
    from agilerl.manifest import ALGORITHM_FIELDS, load_manifest
    from planner.workload import ALGORITHM_CLASSES, Workload

    classes = {c.algo_name: c for c in (GRPO, CISPO, GSPO, LLMREINFORCE, LLMPPO, SFT, DPO)}
    assert set(ALGORITHM_CLASSES.values()) == set(classes) == set(ALGORITHM_FIELDS)
    every = {f for fields in ALGORITHM_FIELDS.values() for f in fields}
    for key, name in ALGORITHM_CLASSES.items():
        params = inspect.signature(classes[name]).parameters
        on_grpo = name not in ("SFT", "DPO")
        grpo = inspect.signature(GRPO).parameters

        def default(field, params=params, grpo=grpo):
            return params[field].default if field in params else grpo[field].default

        assert Workload(algorithm=key).beta == (default("beta") if name != "SFT" else 0.0), name
        for field in every:
            takes = (field in params or (on_grpo and field in grpo)) and default(field) is not None
            section = {"name": name, "model_name": "x", field: 0.1}
            if takes:
                assert field in ALGORITHM_FIELDS[name], (name, field)
                assert getattr(load_manifest({"algorithm": section}).algorithm, field) == 0.1, (name, field)
            else:
                with pytest.raises(Exception, match=f"{field}: {name} takes"):
                    load_manifest({"algorithm": section})


@pytest.mark.parametrize("algorithm", [CISPO, GRPO])
def test_the_gradient_does_not_depend_on_the_micro_batch_size(algorithm):
    """CISPO's mean over the step's tokens and GRPO's over its sequences, whatever the
    micro-batches: the completions have different lengths, so micro-batch token means differ."""
    grads = {}
    for micro_batch in (8, 2, 1):  # 8: the whole step in one, where the loss is the formula's
        agent = make_agent(algorithm=algorithm, micro_batch_size_per_gpu=micro_batch)
        ids, masks, rewards, _ = synthetic_experiences(agent, completion_len=6, seed=3)
        assert len(set(masks.sum(dim=1).tolist())) > 2
        step = agent._optimizer_step

        def record(step=step, micro_batch=micro_batch, agent=agent):
            grads[micro_batch] = [p.grad.clone() for p in agent.trainable_params if p.grad is not None]
            return step()

        agent._optimizer_step = record
        agent.learn((ids, masks, rewards))
    assert grads[8] and any(g.abs().sum() > 0 for g in grads[8])
    for micro_batch in (2, 1):
        for ours, whole in zip(grads[micro_batch], grads[8], strict=True):
            torch.testing.assert_close(ours, whole, rtol=1e-4, atol=1e-7)
