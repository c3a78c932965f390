"""Rollout time under FSDP2: unit by unit, gathered once, gathered once with LoRA merged.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 -m benchmarks.rollout_speed [--reps 5]

GRPO's Hugging Face generation on 2 gloo ranks, a tiny random 4-layer Qwen2 (hidden 256,
LoRA r=16 on every linear, fp32), 2 prompts x 8 completions of 64 new tokens. Four ways,
timed in alternating rounds so drift hits each alike:

- ``dp``: data parallel, for scale;
- ``fsdp/unit``: FSDP2, every unit gathered for every forward (every generated token);
- ``fsdp/once``: ``gather_weights_for_rollout=True``, LoRA beside the base weights;
- ``fsdp/once+merged``: the same, with the actor's LoRA folded into the gathered weights
  (what GRPO does).

The adapters are trained one step first, so the merged delta is not zero. Prints the
median seconds per ``get_action`` and each ratio to ``fsdp/unit``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

MODEL = (
    "tiny:qwen2?hidden_size=256&intermediate_size=512&num_layers=4&num_heads=4&num_kv_heads=2&initializer_range=0.05"
)


def build(mode: str):
    from peft import LoraConfig

    from agilerl.algorithms import GRPO
    from agilerl.distributed import FSDPConfig
    from agilerl.utils.tiny import char_tokenizer

    tokenizer = char_tokenizer()
    fsdp = (
        None
        if mode == "dp"
        else FSDPConfig(param_dtype="float32", reduce_dtype="float32", param_persistence_threshold=0)
    )
    agent = GRPO(
        MODEL,
        tokenizer=tokenizer,
        pad_token_id=tokenizer.pad_token_id,
        pad_token=tokenizer.pad_token,
        lora_config=LoraConfig(
            r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM"
        ),
        batch_size=2,
        group_size=8,
        max_output_tokens=64,
        dtype="float32",
        device="cpu",
        gradient_checkpointing=False,
        logprob_chunk_size=256,
        fsdp_config=fsdp,
        gather_weights_for_rollout=mode.startswith("fsdp/once"),
        seed=0,
    )
    ids, masks = agent.get_action(["1+2=", "3+4="])
    rewards = torch.rand(ids.shape[0] * agent.data_parallel_ranks)
    agent.learn((ids, masks, rewards[agent.local_slice(2)]))  # a non-zero adapter
    return agent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    import agilerl.algorithms.grpo as grpo
    from agilerl.distributed import barrier, init_distributed, is_main_process

    init_distributed()
    modes = ["dp", "fsdp/unit", "fsdp/once", "fsdp/once+merged"]
    agents = {m: build(m) for m in modes}
    mergeable = grpo._mergeable_lora_layers
    times: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(args.reps):
        for mode in modes if rep % 2 == 0 else reversed(modes):
            grpo._mergeable_lora_layers = mergeable if mode == "fsdp/once+merged" else (lambda model, **_: [])
            barrier()
            start = time.perf_counter()
            agents[mode].get_action(["1+2=", "3+4="])
            barrier()
            times[mode].append(time.perf_counter() - start)
    grpo._mergeable_lora_layers = mergeable
    if is_main_process():
        print(
            f"\nrollout on 2 gloo ranks, {MODEL.split('?')[0]} h256 L4, 16 completions x 64 tokens, "
            f"median of {args.reps}"
        )
        print(f"{'mode':<18} {'s per get_action':>16} {'vs fsdp/unit':>13}")
        unit = statistics.median(times["fsdp/unit"])
        for mode in modes:
            t = statistics.median(times[mode])
            print(f"{mode:<18} {t:>16.3f} {t / unit:>12.2f}x")


if __name__ == "__main__":
    main()
