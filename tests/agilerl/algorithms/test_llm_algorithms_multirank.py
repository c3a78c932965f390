"""SFT, DPO, LLMPPO and full fine-tuning on 2 gloo ranks: FSDP2 gives data parallel's update,
checkpoints move between the two, and the value head stays one replica.

Both run in float32 and differ only in reduction order and where AdamW runs (see
test_grpo_multirank's tolerance note).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from agilerl.distributed import FSDPConfig, full_model_state_dict, gather_objects
from tests._dist import DistCases
from tests.agilerl.algorithms._common import lora_state, make_agent, synthetic_experiences
from tests.agilerl.algorithms.test_sft_dpo_ppo import ANSWERS, PROMPTS, WRONG, _offline

cases = DistCases(__name__, nproc=2)

FP32_SHARDED = dict(param_dtype="float32", reduce_dtype="float32", param_persistence_threshold=0)


def _rank_share(batch, rank, world=2):
    n = next(iter(batch.values())).shape[0] // world
    return {k: v[rank * n : (rank + 1) * n] for k, v in batch.items()}


def _weights(agent):
    return {k: v for k, v in full_model_state_dict(agent.model).items()}


def _close(a, b, what):
    for k, v in a.items():
        torch.testing.assert_close(v, b[k], atol=3e-5, rtol=1e-4, msg=lambda m, k=k: f"{what} {k}: {m}")


@cases.case
def sft_and_dpo_under_fsdp_give_data_parallels_update(ctx):
    from agilerl.algorithms import DPO, SFT

    for algorithm, batch_size, make in (
        (SFT, 4, lambda a: a.encode(PROMPTS, ANSWERS)),
        (DPO, 4, lambda a: a.encode(PROMPTS, ANSWERS, WRONG)),
    ):
        for full in (False, True):
            extra = {"lora_config": None} if full else {}
            results = []
            for fsdp in (None, FSDPConfig(**FP32_SHARDED)):
                agent = _offline(
                    algorithm, batch_size=batch_size, micro_batch_size_per_gpu=2, fsdp_config=fsdp, **extra
                )
                batch = _rank_share(make(agent), ctx.rank)
                first = agent.learn(batch)
                second = agent.learn(batch)
                results.append((first, second, _weights(agent) if full else lora_state(agent)))
            (dp1, dp2, dp_w), (fs1, fs2, fs_w) = results
            name = f"{algorithm.algo_name} full={full}"
            assert math.isclose(fs1["loss"], dp1["loss"], rel_tol=1e-5), (name, fs1, dp1)
            assert math.isclose(fs2["loss"], dp2["loss"], rel_tol=1e-4), (name, fs2, dp2)
            assert dp2["loss"] < dp1["loss"], name
            _close(fs_w, dp_w, name)


@cases.case
def full_finetuning_sft_with_parameter_offload_gives_data_parallels_update(ctx):
    # cpu_offload: the fp32 shards and their gradients on the host, AdamW stepping them there; SFT and
    # DPO never run Hugging Face generate, so it needs no colocated engine.
    from agilerl.algorithms import SFT

    results = []
    for fsdp in (None, FSDPConfig(**FP32_SHARDED, cpu_offload=True, defer_grad_sync=False)):
        agent = _offline(SFT, lora_config=None, batch_size=4, micro_batch_size_per_gpu=1, fsdp_config=fsdp, lr=1e-3)
        batch = _rank_share(agent.encode(PROMPTS, ANSWERS), ctx.rank)
        metrics = [agent.learn(batch)["loss"] for _ in range(2)]
        results.append((metrics, _weights(agent)))
    (dp_m, dp_w), (off_m, off_w) = results
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(dp_m, off_m)), (dp_m, off_m)
    _close(off_w, dp_w, "cpu_offload")


@cases.case
def sft_normalises_by_the_tokens_of_the_whole_step_across_ranks(ctx):
    from agilerl.algorithms import SFT

    # Rank 0's two examples have 4 completion tokens, rank 1's 8: a mean of per-rank means would
    # weigh rank 0's tokens double. The step's loss is the mean over all 12 tokens.
    answers = ["3", "7", "123", "456"]
    agent = _offline(SFT, batch_size=4)
    batch = agent.encode(PROMPTS, answers)
    from tests.agilerl.algorithms.test_sft_dpo_ppo import _hf_token_logprobs

    with torch.no_grad():
        logp = _hf_token_logprobs(agent.model, batch["input_ids"], batch["attention_mask"])
    mask = batch["completion_mask"][:, 1:].float()
    whole = float(-(logp * mask).sum() / mask.sum())
    metrics = agent.learn(_rank_share(batch, ctx.rank))
    assert math.isclose(metrics["loss"], whole, rel_tol=1e-5), (metrics, whole)
    means = [float(-(logp[s] * mask[s]).sum() / mask[s].sum()) for s in (slice(0, 2), slice(2, 4))]
    assert not math.isclose(sum(means) / 2, whole, rel_tol=1e-3)  # control: the mean of the ranks' means


@cases.case
def ppo_under_fsdp_gives_data_parallels_update_with_one_value_head(ctx):
    from agilerl.algorithms import LLMPPO

    results = []
    for fsdp in (None, FSDPConfig(**FP32_SHARDED)):
        agent = make_agent(
            algorithm=LLMPPO, group_size=1, batch_size=4, micro_batch_size_per_gpu=1, update_epochs=2, fsdp_config=fsdp
        )
        ids, masks, rewards, _ = synthetic_experiences(agent, num_prompts=4, seed=3)
        metrics = agent.learn((ids, masks, rewards))
        heads = gather_objects([agent.value_head.weight.detach().tolist()])
        assert heads[0] == heads[1]  # the value head's gradients were averaged over the ranks
        results.append((metrics, lora_state(agent), agent.value_head.weight.detach().clone()))
    (dp, dp_lora, dp_head), (fs, fs_lora, fs_head) = results
    assert math.isclose(fs["loss"], dp["loss"], rel_tol=1e-5, abs_tol=1e-7), (fs, dp)
    assert math.isclose(fs["value_loss"], dp["value_loss"], rel_tol=1e-5)
    _close(fs_lora, dp_lora, "ppo")
    torch.testing.assert_close(fs_head, dp_head, atol=3e-5, rtol=1e-4)


@cases.case
def full_finetuning_grpo_under_fsdp_with_offloads_gives_data_parallels_update(ctx):
    common = dict(lora_config=None, micro_batch_size_per_gpu=2, beta=0.1, update_epochs=2, lr=1e-3)
    dp = make_agent(**common)
    assert dp.reference_model is not None
    dp_metrics = _learn(dp)
    dp_after = _weights(dp)
    variants = {
        "fsdp": FSDPConfig(**FP32_SHARDED),
        "offload_no_defer": FSDPConfig(**FP32_SHARDED, optim_cpu_offload=True, defer_grad_sync=False),
        # a threshold that keeps the norms and biases replicated beside sharded matrices
        "replicated": FSDPConfig(
            param_dtype="float32", reduce_dtype="float32", param_persistence_threshold=100, reshard_after_forward=False
        ),
    }
    for name, config in variants.items():
        agent = make_agent(fsdp_config=config, **common)
        trainable = [p for p in agent.model.parameters() if p.requires_grad]
        assert len(trainable) == len(list(agent.model.parameters()))  # every parameter trains
        assert all(p.dtype == torch.float32 for p in trainable)
        assert any(isinstance(p, DTensor) for p in agent.reference_model.parameters())  # a sharded reference
        assert not any(p.requires_grad for p in agent.reference_model.parameters())
        if name == "replicated":
            assert any(not isinstance(p, DTensor) for p in trainable) and any(isinstance(p, DTensor) for p in trainable)
        metrics = _learn(agent)
        assert math.isclose(metrics["loss"], dp_metrics["loss"], rel_tol=1e-5, abs_tol=1e-7), (
            name,
            metrics,
            dp_metrics,
        )
        assert math.isclose(metrics["kl"], dp_metrics["kl"], rel_tol=1e-4, abs_tol=1e-8), name
        _close(_weights(agent), dp_after, name)


def _learn(agent, seed=0):
    return agent.learn(synthetic_experiences(agent, seed=seed)[:3])


@cases.case
def every_algorithm_asks_the_planner_with_fsdp_config_auto(ctx):
    from agilerl.algorithms import DPO, LLMPPO, SFT
    from agilerl.distributed import gather_objects

    for algorithm, extra in (
        (SFT, {"batch_size": 4}),
        (DPO, {"batch_size": 2}),
        (LLMPPO, {"batch_size": 2, "max_output_tokens": 4}),
    ):
        for full in (False, True):
            agent = _offline(
                algorithm,
                fsdp_config="auto",
                logprob_chunk_size="auto",
                gradient_checkpointing="auto",
                max_model_len=16,
                **({"lora_config": None} if full else {}),
                **extra,
            )
            assert agent.plan is not None, algorithm.algo_name
            plans = gather_objects([agent.plan["summary"]])
            assert plans[0] == plans[1]  # rank 0 planned, every rank applied the same plan
            assert (agent.plan["algorithm"], agent.plan["full_finetune"]) == (
                {"SFT": "sft", "DPO": "dpo", "LLMPPO": "ppo"}[algorithm.algo_name],
                full,
            )
            assert agent.micro_batch_size_per_gpu == agent.plan["micro_batch_size_per_gpu"]


@cases.case
def a_resharded_untied_heads_gradient_is_reduced_once_by_the_trainers_own_copy(ctx):
    # Resharded after forward, the chunked head gathers its own copy of the untied lm_head, whose
    # backward reduce-scatters the head's gradient; the model's own one-position head runs without
    # grad, so FSDP2's unit reduce-scatters nothing of the head (before, a zero gradient of it, held
    # whole in fp32 through a deferred-sync step). Kept gathered, the unit's reduce is the only one.
    # Either way two micro-batches a rank give data parallel's update.
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as group

    from agilerl.algorithms import SFT

    reduced: list[str] = []
    original = group.foreach_reduce

    def recording(fsdp_params, *args, **kwargs):
        reduced.extend(p._param_fqn for p in fsdp_params)
        return original(fsdp_params, *args, **kwargs)

    plain = _offline(SFT, lora_config=None, batch_size=4, micro_batch_size_per_gpu=1, lr=1e-3)
    batch = _rank_share(plain.encode(PROMPTS, ANSWERS), ctx.rank)
    plain.learn(batch)
    group.foreach_reduce = recording
    try:
        for reshard in (True, False):
            fsdp = FSDPConfig(**FP32_SHARDED, reshard_after_forward=reshard)
            sharded = _offline(
                SFT, lora_config=None, batch_size=4, micro_batch_size_per_gpu=1, fsdp_config=fsdp, lr=1e-3
            )
            assert not sharded.model.config.tie_word_embeddings
            reduced.clear()
            sharded.learn(batch)
            heads = [name for name in reduced if name.endswith("lm_head.weight")]
            assert heads == ([] if reshard else ["lm_head.weight"]), (reshard, heads)
            assert any(name.endswith("embed_tokens.weight") for name in reduced)  # the units still reduce
            _close(_weights(sharded), _weights(plain), f"reshard_after_forward={reshard}")
    finally:
        group.foreach_reduce = original


@cases.case
def a_full_finetuning_checkpoint_saved_under_fsdp_loads_data_parallel(ctx):
    from agilerl.algorithms import SFT

    sharded = _offline(SFT, lora_config=None, batch_size=4, fsdp_config=FSDPConfig(**FP32_SHARDED))
    batch = _rank_share(sharded.encode(PROMPTS, ANSWERS), ctx.rank)
    sharded.learn(batch)
    path = sharded.save_checkpoint(ctx.shared_dir / "full_sft")
    plain = _offline(SFT, lora_config=None, batch_size=4, seed=9)
    plain.load_checkpoint(path)
    _close(_weights(plain), _weights(sharded), "loaded")
    # the optimizer state came along: the next update is the same
    a, b = sharded.learn(batch), plain.learn(batch)
    assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5)
    _close(_weights(plain), _weights(sharded), "after a step")


@cases.case
def full_finetuning_checkpoints_move_between_bf16_unsharded_and_fp32_shards(ctx):
    # bf16 compute both ways: unsharded the fp32 truth is MasterWeightAdamW's masters (saved as
    # master_weight), under FSDP2 the fp32 shards themselves. Either side resumes from the other
    # with the fp32 values, not their bf16 rounding.
    from agilerl.algorithms import SFT
    from agilerl.distributed import MasterWeightAdamW

    common = dict(lora_config=None, batch_size=4, dtype="bfloat16", lr=1e-3)
    plain = _offline(SFT, **common)
    assert isinstance(plain.optimizer, MasterWeightAdamW)
    batch = _rank_share(plain.encode(PROMPTS, ANSWERS), ctx.rank)
    plain.learn(batch)
    masters = {n: m.clone() for (n, _), (_, m) in zip(plain.model.named_parameters(), plain.optimizer.masters)}
    path = plain.save_checkpoint(ctx.shared_dir / "bf16_plain")
    sharded = _offline(
        SFT, **common, fsdp_config=FSDPConfig(reduce_dtype="float32", param_persistence_threshold=0), seed=7
    )
    sharded.load_checkpoint(path)
    fp32 = _weights(sharded)
    for name, master in masters.items():
        assert torch.equal(fp32[name], master), name  # the shards took the masters, exactly
    sharded.learn(batch)
    path = sharded.save_checkpoint(ctx.shared_dir / "fp32_shards")
    saved = _weights(sharded)
    again = _offline(SFT, **common, seed=8)
    again.load_checkpoint(path)
    for (name, _), (_, master) in zip(again.model.named_parameters(), again.optimizer.masters):
        assert torch.equal(master, saved[name]), name  # the masters took the fp32 shards, exactly


test_dist = cases.pytest_test()
