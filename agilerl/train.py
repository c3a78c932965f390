"""Train from a manifest: ``python -m agilerl.train manifest.yaml [--device cpu|cuda]``.

Also under torchrun: ``torchrun --nproc_per_node=N -m agilerl.train manifest.yaml``;
``training.training_gpus_per_agent`` must then equal N.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

__all__ = ["main", "train"]


def _log(msg: str) -> None:
    from agilerl.distributed import is_main_process

    if is_main_process():
        print(msg, flush=True)


def train(manifest, *, device: str | None = None, max_steps: int | None = None) -> list[list[dict[str, float]]]:
    """Run the manifest; return each population member's per-step metrics."""
    import torch

    from agilerl.distributed import get_world_size, init_distributed
    from agilerl.utils.arithmetic_env import ArithmeticEnv
    from agilerl.utils.utils import create_population

    init_distributed()
    world = get_world_size()
    training, algo = manifest.training, manifest.algorithm
    if world != training.training_gpus_per_agent:
        raise SystemExit(
            f"training.training_gpus_per_agent is {training.training_gpus_per_agent} but {world} rank(s) were "
            f"launched; run `torchrun --nproc_per_node={training.training_gpus_per_agent} -m agilerl.train ...` "
            f"or change the manifest"
        )
    steps = max_steps or training.max_steps
    torch.manual_seed(training.seed)
    from agilerl.algorithms.core.loading import load_tokenizer, resolve_model_source

    tokenizer = load_tokenizer(resolve_model_source(algo.model_name))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    kwargs = dict(
        model_name=algo.model_name,
        pad_token_id=tokenizer.pad_token_id,
        pad_token=tokenizer.pad_token,
        tokenizer=tokenizer,
        lora_config=manifest.lora.to_peft(),
        batch_size=training.rollout_batch_size,
        group_size=algo.group_size,
        beta=algo.beta,
        lr=algo.lr,
        clip_coef=algo.clip_coef,
        max_grad_norm=algo.max_grad_norm,
        update_epochs=algo.update_epochs,
        temperature=algo.temperature,
        max_output_tokens=algo.max_output_tokens,
        max_model_len=algo.max_model_len,
        micro_batch_size_per_gpu=algo.micro_batch_size_per_gpu,
        logprob_chunk_size=algo.logprob_chunk_size,
        gradient_checkpointing=algo.gradient_checkpointing,
        use_separate_reference_adapter=algo.use_separate_reference_adapter,
        load_in_4bit=algo.load_in_4bit,
        vllm_config=algo.vllm,
        offload_weights_during_rollout=algo.offload_weights_during_rollout,
        fsdp_config=algo.fsdp_config(),
        dtype=algo.dtype,
        seed=training.seed,
    )
    start = time.monotonic()
    population = create_population(algo.name, {}, training.population_size, algo_kwargs=kwargs, device=device)
    _log(f"built {len(population)} {algo.name} agent(s) on {world} rank(s) in {time.monotonic() - start:.1f}s")
    histories: list[list[dict[str, float]]] = []
    for agent in population:
        env = ArithmeticEnv(seed=training.seed + agent.index, operators=manifest.environment.operators)
        history = []
        for step in range(1, steps + 1):
            prompts, answers = env.sample(training.rollout_batch_size)
            ids, masks = agent.get_action(prompts)
            local = agent.local_slice(len(prompts))
            texts, stopped = _decode(agent, ids, masks)
            my_answers = [answers[i // agent.group_size] for i in range(local.start, local.stop)]
            rewards = torch.tensor(env.reward(texts, my_answers, stopped))
            metrics = agent.learn((ids, masks, rewards))
            history.append(metrics)
            if step == 1 or step % training.log_every == 0 or step == steps:
                _log(
                    f"agent {agent.index} step {step:4d}  reward {metrics['mean_reward']:.3f}  "
                    f"loss {metrics['loss']:+.4f}  kl {metrics['kl']:.4f}  len {metrics['completion_length']:.2f}"
                )
        histories.append(history)
        if training.checkpoint_dir:
            path = agent.save_checkpoint(Path(training.checkpoint_dir) / f"agent{agent.index}")
            _log(f"saved {path}")
        _summary(agent.index, history)
    _log(f"done in {time.monotonic() - start:.1f}s")
    return histories


def _decode(agent, ids, masks):
    eos = agent._eos_set()
    texts, stopped = [], []
    for row, mask in zip(ids, masks):
        tokens = row[mask.bool()].tolist()
        stopped.append(bool(tokens) and tokens[-1] in eos)
        texts.append(agent.tokenizer.decode(tokens, skip_special_tokens=True))
    return texts, stopped


def _summary(index: int, history: list[dict[str, float]]) -> None:
    rewards = [m["mean_reward"] for m in history]
    k = max(1, len(rewards) // 10)
    first, last = statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:])
    _log(f"agent {index}: mean reward over the first {k} steps {first:.3f}, over the last {k} steps {last:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agilerl.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("manifest", help="path to a manifest YAML")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="compute device (default: cuda when available)")
    parser.add_argument("--max-steps", type=int, default=None, help="override training.max_steps")
    args = parser.parse_args(argv)
    from agilerl.manifest import ManifestError, load_manifest

    try:
        manifest = load_manifest(args.manifest)
    except ManifestError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    train(manifest, device=args.device, max_steps=args.max_steps)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
