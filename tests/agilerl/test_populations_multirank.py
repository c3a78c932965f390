"""Population members on rank groups of their own, and rollout engines on ranks of their own, on
4 gloo ranks: what the seed's manifest (training_gpus_per_agent, rollout_engines_per_agent)
asks of a launch."""

from __future__ import annotations

import math

import torch

from agilerl.distributed import FSDPConfig, gather_objects, get_rank, get_world_size, use_rank_group
from tests._dist import DistCases
from tests.agilerl.algorithms._common import TOKENIZER, lora_state, make_agent
from tests.agilerl.algorithms.test_sft_dpo_ppo import ANSWERS, PROMPTS, _offline

cases = DistCases(__name__, nproc=4)

FP32_SHARDED = dict(param_dtype="float32", reduce_dtype="float32", param_persistence_threshold=0)


@cases.case
def population_members_train_on_disjoint_rank_groups(ctx):
    # Two members of two ranks each, sharded with FSDP2 over their own ranks: each member's
    # update is what one device makes of the member's whole batch, from the member's own seed.
    from agilerl.algorithms import SFT

    member = ctx.rank // 2
    use_rank_group([2 * member, 2 * member + 1])
    try:
        assert (get_rank(), get_world_size()) == (ctx.rank % 2, 2)
        agent = _offline(SFT, batch_size=4, seed=10 + member, fsdp_config=FSDPConfig(**FP32_SHARDED))
        batch = agent.encode(PROMPTS, ANSWERS)
        mine = agent.local_examples(4)
        agent.learn({k: v[mine] for k, v in batch.items()})
        sharded = lora_state(agent)  # gathered within the member's ranks
    finally:
        use_rank_group(None)
    use_rank_group([ctx.rank])  # a group of one: one device, inside the launch
    try:
        alone = _offline(SFT, batch_size=4, seed=10 + member)
        alone.learn(batch)
        for k, v in lora_state(alone).items():
            torch.testing.assert_close(sharded[k], v, atol=3e-5, rtol=1e-4)
    finally:
        use_rank_group(None)
    states = gather_objects([{k: v.tolist() for k, v in sharded.items()}])
    assert states[0] == states[1] and states[2] == states[3]  # one model per member
    assert states[0] != states[2]  # and the members are not the same agent


@cases.case
def engines_on_ranks_of_their_own_get_the_trainers_weights(ctx):
    # Two members of one trainer and one engine rank: the engine generates the trainer's rollouts
    # and, after a learn step and a sync, greedily what the trainer's own model generates.
    from agilerl.algorithms.core.adapters import ACTOR, use_adapter
    from agilerl.utils.remote_engine import (
        HFGenerateEngine,
        RemoteEngine,
        engine_ranks,
        serve_rollout_engine,
    )

    member = ctx.rank // 2
    trainer, engine = 2 * member, 2 * member + 1
    ranks = engine_ranks([trainer], [engine])
    if ctx.rank == engine:
        from agilerl.algorithms.core.loading import resolve_model_source
        from tests.agilerl.algorithms._common import TINY

        use_rank_group([ctx.rank])
        try:
            source = resolve_model_source(TINY)
        finally:
            use_rank_group(None)
        served = serve_rollout_engine(
            HFGenerateEngine(source, dtype="float32", pad_token_id=TOKENIZER.pad_token_id), ranks
        )
        assert served == 2
        return
    use_rank_group([trainer])
    try:
        agent = make_agent(rollout_engine=RemoteEngine(ranks), seed=member, batch_size=2, group_size=2)
        assert not agent.gather_weights_for_rollout  # Hugging Face generate does not run on the trainer
        ids, masks = agent.get_action(PROMPTS[:2])
        assert ids.shape[0] == 4 and masks.sum() > 0
        metrics = agent.learn((ids, masks, torch.tensor([1.0, 0.0, 0.5, 0.2])))
        assert math.isfinite(metrics["loss"])
        agent.sync_engine_weights()
        prompt = TOKENIZER(PROMPTS[:2], add_special_tokens=False)["input_ids"]
        remote = agent.engine.generate(
            prompt, max_tokens=4, temperature=0.0, stop_token_ids=sorted(agent.eos_token_ids())
        )
        local = []
        with torch.no_grad(), use_adapter(agent.model, ACTOR):
            for p in prompt:
                out = agent.model.generate(
                    input_ids=torch.tensor([p]),
                    max_new_tokens=4,
                    do_sample=False,
                    pad_token_id=agent.pad_token_id,
                    eos_token_id=agent.eos_token_id,
                )
                row = out[0, len(p) :].tolist()
                cut = next((i + 1 for i, t in enumerate(row) if t in agent.eos_token_ids()), len(row))
                local.append(row[:cut])
        assert remote == local, (remote, local)
        agent.engine.stop()
    finally:
        use_rank_group(None)


@cases.case
def the_seeds_manifest_trains_members_with_their_own_engines(ctx):
    # training_gpus_per_agent: 1, rollout_engines_per_agent: 1, population_size: 2 on 4 ranks
    from agilerl.manifest import load_manifest
    from agilerl.train import train
    from tests.agilerl.algorithms._common import TINY

    manifest = load_manifest(
        {
            "algorithm": {
                "name": "GRPO",
                "model_name": TINY,
                "group_size": 2,
                "max_output_tokens": 2,
                "dtype": "float32",
                "gradient_checkpointing": False,
                "logprob_chunk_size": None,
            },
            "training": {
                "rollout_batch_size": 2,
                "training_gpus_per_agent": 1,
                "rollout_engines_per_agent": 1,
                "population_size": 2,
                "max_steps": 2,
                "checkpoint_dir": str(ctx.shared_dir / "pop"),
            },
            "lora": {"r": 2, "alpha": 4, "dropout": 0.0},
        }
    )
    histories = train(manifest, device="cpu")
    if ctx.rank % 2:  # an engine rank
        assert histories == []
        return
    assert len(histories) == 1 and len(histories[0]) == 2
    assert (ctx.shared_dir / "pop" / f"agent{ctx.rank // 2}" / "attributes.pt").exists()


test_dist = cases.pytest_test()
