"""GRPO on 2 gloo ranks: data parallel and FSDP2 agree, generation, checkpoints, the trainer CLI.

Tolerance for DP vs FSDP2: both run in float32 and differ only in reduction
order (all-reduce of full gradients vs reduce-scatter of shards) and in where
AdamW runs (fused on shards vs fused on full tensors, or the host for
optim_cpu_offload), each ~1e-7 relative; after one step at lr 1e-2 weights
agree to 1e-6.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from agilerl.distributed import FSDPConfig, barrier, full_optimizer_state_dict
from tests._dist import DistCases, count_calls
from tests.agilerl.algorithms._common import lora_state, make_agent, synthetic_experiences

cases = DistCases(__name__, nproc=2)

FP32_SHARDED = dict(param_dtype="float32", reduce_dtype="float32", param_persistence_threshold=0)


def _learn(agent, seed=0):
    return agent.learn(synthetic_experiences(agent, seed=seed)[:3])


@cases.case
def data_parallel_and_fsdp_give_the_same_update(ctx):
    common = dict(micro_batch_size_per_gpu=2, use_separate_reference_adapter=True, gradient_checkpointing=True)
    dp = make_agent(**common)
    assert not dp.sharded and dp.data_parallel_ranks == 2
    variants = {
        "fsdp": FSDPConfig(**FP32_SHARDED),
        "fsdp_offload_no_defer": FSDPConfig(**FP32_SHARDED, optim_cpu_offload=True, defer_grad_sync=False),
        "fsdp_mixed_replicated": FSDPConfig(
            param_dtype="float32", reduce_dtype="float32", param_persistence_threshold=100, reshard_after_forward=False
        ),
    }
    start = lora_state(dp)
    dp_metrics = _learn(dp)
    dp_after = lora_state(dp)
    assert any(not torch.equal(dp_after[k], start[k]) for k in start)
    for name, config in variants.items():
        agent = make_agent(fsdp_config=config, **common)
        assert any(isinstance(p, DTensor) for p in agent.model.parameters())
        for k, v in lora_state(agent).items():  # same initial adapters through the meta-device path
            assert torch.equal(v, start[k]), (name, k)
        metrics = _learn(agent)
        assert math.isclose(metrics["loss"], dp_metrics["loss"], rel_tol=1e-5, abs_tol=1e-7), (
            name,
            metrics,
            dp_metrics,
        )
        assert math.isclose(metrics["kl"], dp_metrics["kl"], rel_tol=1e-4, abs_tol=1e-7), name
        for k, v in lora_state(agent).items():
            torch.testing.assert_close(v, dp_after[k], atol=1e-6, rtol=1e-5, msg=lambda m, n=name, k=k: f"{n} {k}: {m}")


@cases.case
def the_shared_prompt_prefix_gives_the_one_pass_update_under_dp_and_fsdp(ctx):
    # Grouped rows (a group's rows share their prompt), micro-batches of a whole group: each
    # forward runs the prompt once, then every row's completion; FSDP2's units then run two
    # forwards per backward. The update must equal the one-pass forward's, and the shared
    # forward must really run (its prefix pass has one row per group).
    common = dict(micro_batch_size_per_gpu=4, group_size=4, gradient_checkpointing=True)
    for config in (None, FSDPConfig(**FP32_SHARDED)):
        results = []
        for share in (False, True):
            agent = make_agent(fsdp_config=config, share_prompt_prefix=share, **common)
            rows = []
            hook = agent.model.get_input_embeddings().register_forward_hook(
                lambda m, i, o, rows=rows: rows.append(i[0].shape[0])
            )
            metrics = agent.learn(synthetic_experiences(agent, num_prompts=2, grouped=True, seed=4)[:3])
            hook.remove()
            results.append((metrics, lora_state(agent), rows))
        (m0, s0, rows0), (m1, s1, rows1) = results
        assert set(rows0) == {4} and 1 in rows1, (rows0, rows1)
        assert math.isclose(m0["loss"], m1["loss"], rel_tol=1e-5, abs_tol=1e-7), (config, m0, m1)
        assert math.isclose(m0["grad_norm"], m1["grad_norm"], rel_tol=1e-4), (config, m0, m1)
        for k in s0:
            torch.testing.assert_close(s1[k], s0[k], atol=1e-6, rtol=1e-5)
    # Rank 0's rows share a prompt, rank 1's share none: under FSDP2 both run one pass (a second
    # forward on one rank alone would leave the other's all-gathers waiting).
    agent = make_agent(fsdp_config=FSDPConfig(**FP32_SHARDED), **common)
    ids, masks, rewards, _ = synthetic_experiences(agent, num_prompts=2, grouped=ctx.rank == 0, seed=5)
    rows = []
    hook = agent.model.get_input_embeddings().register_forward_hook(lambda m, i, o: rows.append(i[0].shape[0]))
    assert math.isfinite(agent.learn((ids, masks, rewards))["loss"])
    hook.remove()
    assert set(rows) == {4}, rows


@cases.case
def cispo_gspo_and_reinforce_give_the_same_update_under_data_parallel_and_fsdp(ctx):
    # The three objectives built on GRPO's loop, on 2 ranks: FSDP2's update is data parallel's
    # (advantages from every rank's rewards, a second epoch where the objective has ratios).
    from agilerl.algorithms import CISPO, GSPO, LLMREINFORCE

    for algorithm, extra in ((CISPO, {"update_epochs": 2}), (GSPO, {"update_epochs": 2}), (LLMREINFORCE, {})):
        common = dict(algorithm=algorithm, micro_batch_size_per_gpu=2, **extra)
        dp = make_agent(**common)
        fsdp = make_agent(fsdp_config=FSDPConfig(**FP32_SHARDED), **common)
        dp_metrics, fsdp_metrics = _learn(dp), _learn(fsdp)
        assert math.isfinite(dp_metrics["loss"]) and dp_metrics["grad_norm"] > 0, algorithm.algo_name
        assert math.isclose(fsdp_metrics["loss"], dp_metrics["loss"], rel_tol=1e-5, abs_tol=1e-7), algorithm.algo_name
        for k, v in lora_state(fsdp).items():
            torch.testing.assert_close(v, lora_state(dp)[k], atol=3e-5, rtol=1e-4)


@cases.case
def bf16_fsdp_with_partly_replicated_lora_layers(ctx):
    # As in real models: with the default bf16 compute, some LoRA matrices fall under
    # the persistence threshold (replicated, fp32) beside sharded ones in the same layer
    # (threshold 150 here: q's A and B (4 x 32) are replicated, the MLP's B (64 x 4) is
    # sharded). PEFT reads lora_A's dtype outside lora_A, so the casts must cover the
    # whole unit, in checkpoint recompute too.
    reference = make_agent()  # fp32, unsharded: the yardstick
    for reshard in (True, False):
        agent = make_agent(
            fsdp_config=FSDPConfig(param_persistence_threshold=150, reshard_after_forward=reshard),
            gradient_checkpointing=True,
            use_separate_reference_adapter=True,
        )
        replicated = [n for n, p in agent.model.named_parameters() if ".lora_" in n and not isinstance(p, DTensor)]
        sharded = [n for n, p in agent.model.named_parameters() if ".lora_" in n and isinstance(p, DTensor)]
        assert replicated and sharded
        ids, masks, _, _ = synthetic_experiences(agent)
        attention = agent._attention_mask(ids, masks)
        with torch.no_grad():
            ours = agent.token_logprobs(ids, attention)
            exact = reference.token_logprobs(ids, attention)
        torch.testing.assert_close(ours, exact, atol=0.05, rtol=0.02)  # bf16 compute
        metrics = _learn(agent)
        assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
        out, masks = agent.get_action(["1+2=", "3+4="])
        assert out.shape[0] == 4 and masks.sum() > 0


@cases.case
def tensor_parallel_gives_the_same_update_as_data_parallel(ctx):
    # tp=2 on 2 ranks: one tensor-parallel group processes every completion; data
    # parallel gives each rank half. Both average the same per-sequence losses.
    common = dict(micro_batch_size_per_gpu=2, use_separate_reference_adapter=True)
    dp = make_agent(**common)
    dp_metrics = _learn(dp)
    tp = make_agent(fsdp_config=FSDPConfig(**FP32_SHARDED, tp=2), **common)
    assert tp.data_parallel_ranks == 1 and tp.local_slice(2) == slice(0, 8)
    q = tp.model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert q.to_local().shape[0] == q.shape[0] // 2  # heads split over the TP group
    metrics = _learn(tp)
    assert math.isclose(metrics["loss"], dp_metrics["loss"], rel_tol=1e-5, abs_tol=1e-7)
    for k, v in lora_state(tp).items():
        torch.testing.assert_close(v, lora_state(dp)[k], atol=3e-5, rtol=1e-4)
    ids, masks = tp.get_action(["1+2=", "3+4="])
    from agilerl.distributed import gather_objects

    both = gather_objects([ids.tolist()])
    assert both[0] == both[1]  # the TP group sampled identical completions


@cases.case
def expert_parallel_moe_gives_the_same_update_as_data_parallel(ctx):
    moe = "tiny:qwen3_moe?hidden_size=32&intermediate_size=64&num_layers=2&initializer_range=0.1"
    common = dict(
        model_name=moe, micro_batch_size_per_gpu=2, use_separate_reference_adapter=True, gradient_checkpointing=True
    )
    dp = make_agent(**common)
    dp_metrics = _learn(dp)
    ep = make_agent(fsdp_config=FSDPConfig(**FP32_SHARDED, ep=2, routed_expert_chunk_mib=1), **common)
    from agilerl.distributed import fsdp_layout

    layout = fsdp_layout(ep.model)
    assert layout.moe is not None and layout.moe.ep == 2 and layout.expert_units
    metrics = _learn(ep)
    assert math.isclose(metrics["loss"], dp_metrics["loss"], rel_tol=1e-5, abs_tol=1e-7)
    assert math.isclose(metrics["grad_norm"], dp_metrics["grad_norm"], rel_tol=1e-4)
    for k, v in lora_state(ep).items():  # expert LoRA gathered over the EP group
        torch.testing.assert_close(v, lora_state(dp)[k], atol=3e-5, rtol=1e-4)
    ids, masks = ep.get_action(["1+2=", "3+4="])  # every decode step joins the all-to-alls
    assert masks.sum() > 0
    path = ep.save_checkpoint(ctx.shared_dir / "ep_ckpt")
    fresh = make_agent(seed=5, **common)
    fresh.load_checkpoint(path)
    for k, v in lora_state(ep).items():
        assert torch.equal(lora_state(fresh)[k], v), k
    # and back into the same expert-parallel layout, where each rank holds half the experts
    resumed = make_agent(seed=5, fsdp_config=FSDPConfig(**FP32_SHARDED, ep=2, routed_expert_chunk_mib=1), **common)
    resumed.load_checkpoint(path)
    for k, v in lora_state(ep).items():
        assert torch.equal(lora_state(resumed)[k], v), k
    # routed_expert_chunk_mib=None: as documented, the largest of 64/128/256/512 MiB the memory
    # estimate fits. The visible "device" is this host's RAM, which holds a tiny model at any chunk.
    auto = make_agent(fsdp_config=FSDPConfig(**FP32_SHARDED), **common)
    assert auto.fsdp_config.routed_expert_chunk_mib == 512
    assert fsdp_layout(auto.model).moe.chunk_mib == 512  # the row-wise experts, not PEFT's merged stack
    assert math.isclose(_learn(auto)["loss"], dp_metrics["loss"], rel_tol=1e-5, abs_tol=1e-7)
    # Where the estimate cannot answer (an engine setting it does not plan, say), the smallest
    # chunk, as the other open fields keep their safe value; it stopped the agent's construction.
    import agilerl.algorithms.core.autoplan as autoplan

    def cannot(*_args):
        raise ValueError("the memory estimate plans a colocated vLLM engine on one GPU that sleeps")

    pick, autoplan.pick_expert_chunk = autoplan.pick_expert_chunk, cannot
    try:
        fallback = make_agent(fsdp_config=FSDPConfig(**FP32_SHARDED), **common)
    finally:
        autoplan.pick_expert_chunk = pick
    assert fallback.fsdp_config.routed_expert_chunk_mib == 64


@cases.case
def auto_checkpointing_and_chunk_agree_on_every_rank_under_dp_and_fsdp(ctx):
    from agilerl.distributed import gather_objects

    for fsdp in (None, FSDPConfig(**FP32_SHARDED)):
        agent = make_agent(fsdp_config=fsdp, gradient_checkpointing="auto", logprob_chunk_size="auto")
        both = gather_objects([(agent.gradient_checkpointing, agent.logprob_chunk_size)])
        assert both[0] == both[1] and isinstance(both[0][1], int), both
        assert agent.gradient_checkpointing in (True, False)
        _learn(agent)


@cases.case
def gpt_oss_trains_under_fsdp_in_hugging_faces_expert_loop(ctx):
    # gpt-oss's experts (transposed, biased) are not the row-wise experts' layout: with
    # routed_expert_chunk_mib=None, GRPO keeps it unset and FSDP2 matches data parallel.
    gpt_oss = "tiny:gpt_oss?hidden_size=32&intermediate_size=64&num_layers=2&initializer_range=0.1"
    common = dict(model_name=gpt_oss, micro_batch_size_per_gpu=2, gradient_checkpointing=True)
    dp = make_agent(**common)
    dp_metrics = _learn(dp)
    sharded = make_agent(fsdp_config=FSDPConfig(**FP32_SHARDED), **common)
    from agilerl.distributed import fsdp_layout

    assert sharded.fsdp_config.routed_expert_chunk_mib is None and fsdp_layout(sharded.model).moe is None
    metrics = _learn(sharded)
    assert math.isclose(metrics["loss"], dp_metrics["loss"], rel_tol=1e-5, abs_tol=1e-7)
    assert math.isclose(metrics["grad_norm"], dp_metrics["grad_norm"], rel_tol=1e-4)
    for k, v in lora_state(sharded).items():
        torch.testing.assert_close(v, lora_state(dp)[k], atol=3e-5, rtol=1e-4)


@cases.case
def fsdp_weight_offload_during_rollout_frees_the_shards_and_restores_them(ctx):
    from agilerl.algorithms.core.offload import WeightOffload
    from tests.agilerl.algorithms.test_grpo_single import OffloadCheckingEngine

    config = FSDPConfig(**FP32_SHARDED)
    agent, twin = make_agent(fsdp_config=config), make_agent(fsdp_config=config)
    before = {n: (p.to_local() if isinstance(p, DTensor) else p).clone() for n, p in agent.model.named_parameters()}
    agent.engine = engine = OffloadCheckingEngine(agent)
    agent._weight_offload = WeightOffload(agent.model)  # what offload_weights_during_rollout=True builds
    agent.get_action(["1+1=", "2+2="])
    assert engine.held == 0 and engine.lora_held == 0  # every local shard was freed while generating
    for n, p in agent.model.named_parameters():
        assert torch.equal(p.to_local() if isinstance(p, DTensor) else p, before[n]), n
    batch = synthetic_experiences(agent)[:3]
    assert agent.learn(batch)["loss"] == twin.learn(batch)["loss"]


@cases.case
def fsdp_generation_can_gather_each_unit_once_and_leaves_the_shards_as_they_were(ctx):
    import torch.distributed as dist

    results = {}
    for once in (False, True):
        agent = make_agent(
            fsdp_config=FSDPConfig(**FP32_SHARDED), gather_weights_for_rollout=once, max_output_tokens=6, seed=3
        )
        before = {n: p.to_local().clone() for n, p in agent.model.named_parameters()}
        torch.manual_seed(11)
        with count_calls(dist, "all_gather_single") as gathers:
            ids, masks = agent.get_action(["1+2=", "3+4="])
        results[once] = (ids, masks, gathers.n)
        for n, p in agent.model.named_parameters():
            assert isinstance(p, DTensor) and torch.equal(p.to_local(), before[n]), n  # resharded, unchanged
        metrics = _learn(agent)  # training goes on with the units' own reshard setting
        assert math.isfinite(metrics["loss"])
    assert torch.equal(results[False][0], results[True][0]) and torch.equal(results[False][1], results[True][1])
    per_unit, once = results[False][2], results[True][2]
    units = sum(1 for m in agent.model.modules() if type(m).__name__.startswith("FSDP"))
    assert 0 < once <= units < per_unit, (once, units, per_unit)  # each unit once, not once a token
    # The reference pass holds the units gathered too: each gathers once for it, however many
    # micro-batches (and passes) it runs.
    reference = {}
    for once in (False, True):
        agent = make_agent(
            fsdp_config=FSDPConfig(**FP32_SHARDED), gather_weights_for_rollout=once, micro_batch_size_per_gpu=2, seed=3
        )
        counted = {}
        with count_calls(dist, "all_gather_single") as gathers:

            @contextlib.contextmanager
            def observe(name, counted=counted, gathers=gathers):
                start = gathers.n
                yield
                counted[name] = counted.get(name, 0) + gathers.n - start

            agent.phase_observer = observe
            _learn(agent)
        reference[once] = counted["reference"]
    assert 0 < reference[True] <= units < reference[False], (reference, units)


@cases.case
def fsdp_gather_once_generates_with_lora_merged_and_leaves_the_shards_as_they_were(ctx):
    from torch.distributed.fsdp import FSDPModule

    from agilerl.algorithms.core.adapters import ACTOR, tuner_layers, use_adapter

    # Every base weight sharded (folded into its gathered copy), then the attention's replicated
    # (32 x 32 and smaller, below a threshold of 1100: merged copies) beside the MLP's sharded ones;
    # and with reshard_after_forward=False, where the unmerged forward below leaves every unit gathered.
    for threshold, reshard in ((0, True), (1100, True), (0, False)):
        config = FSDPConfig(
            **{**FP32_SHARDED, "param_persistence_threshold": threshold, "reshard_after_forward": reshard}
        )
        agent = make_agent(fsdp_config=config, gather_weights_for_rollout=True, max_output_tokens=6)
        _learn(agent)  # a non-zero adapter to fold in
        params = dict(agent.model.named_parameters())
        before = {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in params.items()}
        replicated = {n for n, p in params.items() if ".base_layer.weight" in n and not isinstance(p, DTensor)}
        assert bool(replicated) == (threshold == 1100) and (
            not replicated or len(replicated) < sum(".base_layer.weight" in n for n in params)
        ), (threshold, replicated)
        ids = torch.randint(4, 30, (2, 9), generator=torch.Generator().manual_seed(0))
        agent.model.eval()
        copied = []  # the layers generating on merged copies: only the replicated ones, the rest fold in place
        copies = agent._merged_copies_for_rollout

        def recording(layers=None, copied=copied, copies=copies):
            copied.extend(layers or [])
            return copies(layers)

        agent._merged_copies_for_rollout = recording
        with torch.no_grad(), use_adapter(agent.model, ACTOR):
            unmerged = agent.model(input_ids=ids).logits  # unit by unit, the adapters beside the base
            with agent._gathered_for_rollout():
                merged_layers = [layer for layer in tuner_layers(agent.model) if layer.merged]
                merged = agent.model(input_ids=ids).logits
        del agent._merged_copies_for_rollout
        assert len(copied) == len({n.rsplit(".base_layer", 1)[0] for n in replicated}), (threshold, reshard)
        with torch.no_grad(), use_adapter(agent.model, None):
            base = agent.model(input_ids=ids).logits
        agent.model.train()
        for m in agent.model.modules():  # reshard_after_forward=False: the base forward left its units gathered
            if isinstance(m, FSDPModule):
                m.reshard()
        assert len(merged_layers) == len(tuner_layers(agent.model)) > 0, threshold  # sharded and replicated
        torch.testing.assert_close(merged, unmerged, atol=2e-5, rtol=1e-5)
        assert (base - unmerged).abs().max() > 1e-3  # the adapter matters, so the comparison means something
        assert not any(layer.merged for layer in tuner_layers(agent.model))
        for n, p in agent.model.named_parameters():
            assert p is params[n], n  # the same parameter objects, replicated ones included
            local = p.to_local() if isinstance(p, DTensor) else p
            assert torch.equal(local, before[n]), n  # bit for bit
        agent.get_action(["1+2=", "3+4="])
        assert math.isfinite(_learn(agent)["loss"])


@cases.case
def data_parallel_ranks_sample_differently(ctx):
    from agilerl.distributed import gather_objects

    agent = make_agent(batch_size=1, group_size=8, max_output_tokens=6)  # one prompt split over 2 ranks
    ids, _ = agent.get_action(["1+2="])
    both = gather_objects([ids.tolist()])
    assert both[0] != both[1]  # different completions of the same prompt


@cases.case
def fsdp_meta_loading_matches_the_checkpoint(ctx):
    dp = make_agent()
    fsdp = make_agent(fsdp_config=FSDPConfig(**FP32_SHARDED))
    ids, masks, _, _ = synthetic_experiences(dp)
    attention = dp._attention_mask(ids, masks)
    with torch.no_grad():
        torch.testing.assert_close(
            fsdp.token_logprobs(ids, attention), dp.token_logprobs(ids, attention), atol=1e-5, rtol=1e-5
        )


@cases.case
def fsdp_meta_loading_draws_the_configs_adapter_init(ctx):
    """init_lora_weights=False (B random, the adapter not the identity) drawn on the meta-device
    path as on the plain one; a control that the init shows in the log-probs at all."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    dp = make_agent(lora_config=lora)
    fsdp = make_agent(lora_config=lora, fsdp_config=FSDPConfig(**FP32_SHARDED))
    identity = make_agent()
    ids, masks, _, _ = synthetic_experiences(dp)
    attention = dp._attention_mask(ids, masks)
    with torch.no_grad():
        drawn = dp.token_logprobs(ids, attention)
        torch.testing.assert_close(fsdp.token_logprobs(ids, attention), drawn, atol=1e-5, rtol=1e-5)
        assert (identity.token_logprobs(ids, attention) - drawn).abs().max() > 1e-3


@cases.case
def fsdp_sends_an_engine_the_checkpoints_names_and_tensors(ctx):
    """Sharded from the meta device (no loading record to revert): a MoE model's sync to an engine
    that reads checkpoints is the checkpoint itself, experts one by one, on every rank."""
    import safetensors.torch
    from peft import LoraConfig

    from agilerl.algorithms.grpo import _merged_weights
    from agilerl.utils.logprobs import causal_lm

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    agent = make_agent(model_name="tiny:qwen3_moe", lora_config=lora, fsdp_config=FSDPConfig(**FP32_SHARDED))
    disk = {}
    for file in sorted(Path(agent.model_source).glob("*.safetensors")):
        disk.update(safetensors.torch.load_file(file))
    sent = dict(_merged_weights(agent.model, causal_lm(agent.model), checkpoint_names=True))
    assert sorted(sent) == sorted(disk) and any(".experts.0.gate_proj." in n for n in sent)
    for name, tensor in disk.items():
        assert torch.equal(sent[name], tensor), name


@cases.case
def generation_where_ranks_finish_at_different_lengths(ctx):
    from transformers import LogitsProcessor, LogitsProcessorList

    class Force(LogitsProcessor):
        def __init__(self, stop: bool):
            self.stop = stop

        def __call__(self, input_ids, scores):
            scores = scores.clone()
            if self.stop:  # rank 0 ends every completion at once
                scores[:] = -float("inf")
                scores[:, 2] = 0
            else:  # rank 1 never ends
                scores[:, 2] = -float("inf")
            return scores

    # Unit by unit every forward gathers, so generate keeps finished ranks in step (synced_gpus);
    # gathered once its forwards communicate nothing, and each rank stops on its own.
    for once in (False, True):
        agent = make_agent(fsdp_config=FSDPConfig(**FP32_SHARDED), max_output_tokens=6, gather_weights_for_rollout=once)
        assert agent._generate_needs_sync() is (not once)
        agent.generation_kwargs["logits_processor"] = LogitsProcessorList([Force(ctx.rank == 0)])
        ids, masks = agent.get_action(["1+2=", "3+4="])
        lengths = masks.sum(1).tolist()
        assert lengths == ([1] * 4 if ctx.rank == 0 else [6] * 4), lengths
        # And again, and a learn step, to show the collectives stayed aligned.
        ids, masks = agent.get_action(["5+5=", "6+1="])
        assert math.isfinite(agent.learn((ids, masks, torch.rand(ids.shape[0])))["loss"])


@cases.case
def fsdp_checkpoint_loads_into_data_parallel(ctx):
    fsdp = make_agent(
        fsdp_config=FSDPConfig(**FP32_SHARDED, optim_cpu_offload=True), use_separate_reference_adapter=True
    )
    _learn(fsdp, seed=3)
    path = fsdp.save_checkpoint(ctx.shared_dir / "grpo_ckpt")
    saved = torch.load(path, weights_only=False)
    assert all(not isinstance(v, DTensor) for w in saved["adapters"].values() for v in w.values())
    dp = make_agent(seed=77, use_separate_reference_adapter=True)
    dp.load_checkpoint(ctx.shared_dir / "grpo_ckpt")
    for k, v in lora_state(fsdp).items():
        assert torch.equal(lora_state(dp)[k], v), k
    fsdp_optim = full_optimizer_state_dict(fsdp.model, fsdp.optimizer)
    dp_optim = full_optimizer_state_dict(dp.model, dp.optimizer)
    assert set(fsdp_optim) == set(dp_optim) and fsdp_optim
    for k in fsdp_optim:
        for field in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(dp_optim[k][field], fsdp_optim[k][field])
    # Both continue identically from the same state.
    a, b = _learn(fsdp, seed=4), _learn(dp, seed=4)
    assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5, abs_tol=1e-7)
    barrier()


@cases.case
def a_checkpoint_one_rank_cannot_load_is_skipped_by_every_rank(ctx):
    """Rank 1 cannot read step 4's file (a torn copy on its node): both ranks resume from step 2,
    not rank 0 from step 4's shards with rank 1 on step 2's."""
    from agilerl.train import STEP_PREFIX, _resume
    from agilerl.utils.arithmetic_env import ArithmeticEnv

    folder = ctx.shared_dir / "resume_agreement"
    agent = make_agent(fsdp_config=FSDPConfig(**FP32_SHARDED))
    env = ArithmeticEnv(seed=1)
    for step in (2, 4):
        agent.steps = step
        agent.save_checkpoint(
            folder / f"{STEP_PREFIX}{step:08d}", extra={"env_rng": env.get_state(), "history": [{}] * step}
        )
    load = agent.load_checkpoint

    def torn_on_rank_1(path):
        if ctx.rank == 1 and path.name.endswith("4"):
            raise EOFError("torn")
        return load(path)

    agent.load_checkpoint = torn_on_rank_1
    agent.steps = 0
    history, path = _resume(agent, env, folder)
    assert agent.steps == 2 and len(history) == 2 and path.name == f"{STEP_PREFIX}{2:08d}", (ctx.rank, agent.steps)
    # Step 4 alone: rank 0 would hold step 4's state and rank 1 none, and their loops would not
    # match; every rank says so instead.
    import shutil

    barrier()
    if ctx.rank == 0:
        shutil.rmtree(folder / f"{STEP_PREFIX}{2:08d}")
    barrier()
    agent.steps = 0
    try:
        _resume(agent, env, folder)
    except ValueError as err:
        assert "no checkpoint under" in str(err) and "loads on every rank" in str(err), err
    else:
        raise AssertionError(f"rank {ctx.rank} resumed at step {agent.steps} beside a rank that could not")
    barrier()


@cases.case
def train_cli_short_runs_data_parallel_fsdp_and_tensor_parallel(ctx):
    from agilerl.manifest import load_manifest
    from agilerl.train import train
    from tests.agilerl.algorithms._common import TINY

    sharded = {"param_dtype": "float32", "param_persistence_threshold": 0}
    # (one prompt under tp=2: the two ranks are one data-parallel rank, which takes it whole)
    for fsdp, prompts in ((False, 2), (sharded, 2), ({**sharded, "tp": 2}, 1)):
        manifest = load_manifest(
            {
                "algorithm": {
                    "model_name": TINY,
                    "fsdp": fsdp,
                    "group_size": 4,
                    "max_output_tokens": 2,
                    "dtype": "float32",
                    "lr": 0.01,
                    "micro_batch_size_per_gpu": 2,
                },
                "training": {"rollout_batch_size": prompts, "training_gpus_per_agent": 2, "max_steps": 2},
                "lora": {"r": 2, "alpha": 4, "dropout": 0.0},
            }
        )
        history = train(manifest, device="cpu")
        assert len(history) == 1 and len(history[0]) == 2
        assert all(math.isfinite(m["loss"]) for m in history[0])


@contextlib.contextmanager
def _kept_logs():
    """The library's log messages (INFO and up) while the block runs, as a list."""
    import logging

    messages: list[str] = []

    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    kept, library = Kept(logging.INFO), logging.getLogger("agilerl")
    level = library.level
    library.addHandler(kept)
    library.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        library.removeHandler(kept)
        library.setLevel(level)


@cases.case
def auto_fsdp_asks_the_planner_once_and_every_rank_applies_it(ctx):

    from agilerl.distributed import gather_objects

    with _kept_logs() as messages:
        agent = make_agent(
            fsdp_config="auto", logprob_chunk_size="auto", gradient_checkpointing="auto", max_model_len=16
        )
    assert agent.plan is not None
    plans = gather_objects([agent.plan["summary"]])
    assert plans[0] == plans[1]  # rank 0 planned, every rank applied the same plan
    logged = "\n".join(messages)
    assert ("fsdp_config='auto' planned" in logged) == (ctx.rank == 0)  # the main rank says it, once
    # each CPU rank's share of the free memory, read a moment apart, is one figure: no range is said
    assert "the ranks see different memory" not in logged, logged
    assert agent.logprob_chunk_size == agent.plan["logprob_chunk_size"]
    assert agent.micro_batch_size_per_gpu == agent.plan["micro_batch_size_per_gpu"]
    assert agent.sharded == (agent.plan["fsdp"] is not None)
    metrics = _learn(agent)
    assert math.isfinite(metrics["loss"])


@cases.case
def auto_fsdp_plans_for_the_least_memory_any_rank_sees(ctx):
    """Rank 1's GPU is smaller and its node's host holds less than rank 0's (another kind of GPU,
    a node with a tighter cgroup): the plan rank 0 makes, and every rank applies, is judged
    against rank 1's, and rank 0 says the ranks differ."""

    import agilerl.algorithms.core.autoplan as autoplan
    from agilerl.distributed import gather_objects
    from planner.hardware import Cluster, gpu_by_name, with_memory

    gib = 2**30
    gpu_gib, host_gib = (80, 512) if ctx.rank == 0 else (40, 256)
    gpu = with_memory(gpu_by_name("H100-80GB"), gpu_gib)

    def seen(world_size, judge_host=False):
        host = host_gib * gib if judge_host else None
        return Cluster(gpu=gpu, num_gpus=world_size, host_memory_per_node_bytes=host)

    visible = autoplan.visible_cluster
    autoplan.visible_cluster = seen
    try:
        with _kept_logs() as messages:
            agent = make_agent(fsdp_config="auto", max_model_len=16)
    finally:
        autoplan.visible_cluster = visible
    assert agent.plan["capacity_gib"] == 40  # rank 1's GPU, on rank 1 as on rank 0
    assert "of 256.00 GiB" in agent.plan["summary"], agent.plan["summary"]  # rank 1's node's host
    assert len(set(gather_objects([agent.plan["summary"]]))) == 1
    logged = "\n".join(messages)
    said = "the ranks see different memory (40.00-80.00 GiB a device, 256.00-512.00 GiB of host a node)"
    assert (said in logged) == (ctx.rank == 0), logged


@cases.case
def a_rank_that_cannot_read_its_memory_stops_every_rank_instead_of_leaving_them_waiting(ctx):
    import agilerl.algorithms.core.autoplan as autoplan

    visible = autoplan.visible_cluster

    def unreadable(world_size, judge_host=False):
        if ctx.rank == 1:
            raise OSError("no device properties")
        return visible(world_size, judge_host=judge_host)

    autoplan.visible_cluster = unreadable
    try:
        autoplan.least_visible_cluster(ctx.world_size)
    except RuntimeError as err:
        assert str(err) == "rank 1 could not read its device's memory: OSError: no device properties", err
    else:
        raise AssertionError(f"rank {ctx.rank} planned beside a rank that could not read its memory")
    finally:
        autoplan.visible_cluster = visible


@cases.case
def auto_fsdp_that_nothing_fits_is_one_line_with_what_would(ctx):
    """Llama-3.1-405B's shape (its config alone: it is planned before any weight loads) on two
    CPU ranks: the plan's table is logged, the error is one line saying what would fit."""
    import json

    folder = ctx.shared_dir / "llama405b"
    if ctx.rank == 0:
        folder.mkdir(exist_ok=True)
        config = {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 16384,
            "intermediate_size": 53248,
            "num_hidden_layers": 126,
            "num_attention_heads": 128,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
        }
        (folder / "config.json").write_text(json.dumps(config))
    barrier()
    try:
        make_agent(model_name=str(folder), fsdp_config="auto", max_model_len=64)
    except ValueError as err:
        message = str(err)
    else:
        raise AssertionError("a 405B model was planned to fit on two CPU ranks")
    assert "\n" not in message, message
    assert message.startswith("fsdp_config='auto': no configuration fits in "), message
    assert "what would fit: " in message or "nothing nearby fits" in message, message


@cases.case
def train_cli_with_fsdp_auto(ctx):
    from agilerl.manifest import load_manifest
    from agilerl.train import train
    from tests.agilerl.algorithms._common import TINY

    manifest = load_manifest(
        {
            "algorithm": {
                "model_name": TINY,
                "fsdp": "auto",
                "group_size": 4,
                "max_output_tokens": 2,
                "dtype": "float32",
                "max_model_len": 8,
            },
            "training": {"rollout_batch_size": 2, "training_gpus_per_agent": 2, "max_steps": 1},
            "lora": {"r": 2, "alpha": 4, "dropout": 0.0},
        }
    )
    history = train(manifest, device="cpu")
    assert len(history[0]) == 1


test_dist = cases.pytest_test()
