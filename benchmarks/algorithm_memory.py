"""Every algorithm, LoRA and full fine-tuning: the planner's estimate against bf16 probes.

    python -m benchmarks.algorithm_memory [--device cpu] [--rerun]

The probe runs the real trainer of each algorithm (GRPO, LLMPPO with its value head, SFT,
DPO with its reference pass) in the dtypes users train in: a bf16 base with fp32 LoRA
adapters, or with ``lora_config=None`` every parameter (fp32 shards under FSDP2, or a bf16
model beside MasterWeightAdamW's fp32 masters, gradients and moments, and a frozen bf16
reference copy). One device, and FSDP2 on 2 gloo ranks with and without deferred gradient
sync. Two tiny models that no term was written against (a Qwen2 with grouped-query
attention and a Llama without), 2 micro-batches a rank. Nothing is fitted: every
configuration is held out, except that the moment of a trained lm_head's backward (its unit's
own reduce-scatter beside the chunked head's workspace) was revised after these rows read 5-7%
low. The ``development`` rows are the full fine-tuning probes the terms were first checked
against, another model and length. The last six (``tied``) fully fine-tune a Qwen2 whose head
is its embedding table, on one device and on 2 ranks (resharded after forward or kept
gathered). CISPO, GSPO and LLMREINFORCE run GRPO's passes and hold its memory; their rows would
be GRPO's.

Measurements are cached in ``benchmarks/results/algorithms_<device>.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from agilerl.distributed import FSDPConfig
from benchmarks._probe_cache import cache_key, estimate_request, measure_cached, saved_coefficients
from planner.probe import ProbeRequest
from planner.workload import Workload

ROOT = Path(__file__).resolve().parent.parent

MODELS = {
    # the model the full fine-tuning terms were first checked against (the development set below)
    "q128-L3": "tiny:qwen2?hidden_size=128&intermediate_size=384&num_layers=3&num_heads=4&num_kv_heads=2"
    "&vocab_size=2048",
    "q96-L4": "tiny:qwen2?hidden_size=96&intermediate_size=320&num_layers=4&num_heads=4&num_kv_heads=2&vocab_size=1536",
    "l128-L3": "tiny:llama?hidden_size=128&intermediate_size=256&num_layers=3&num_heads=4&num_kv_heads=4"
    "&vocab_size=1024",
    # a tied head (the embedding table in the root unit), as in the smaller Qwen2.5, Llama 3.2 and Gemma
    "t128-L4": "tiny:qwen2?hidden_size=128&intermediate_size=768&num_layers=4&num_heads=4&num_kv_heads=2"
    "&vocab_size=3072&tie_word_embeddings=true",
}
PHASES = ("reference", "learn", "step")
ALGORITHMS = ("grpo", "ppo", "sft", "dpo")


def _configs() -> list[dict]:
    out = []
    for world in (1, 2):
        for algorithm in ALGORITHMS:
            for full in (False, True):
                out.append(
                    dict(
                        algorithm=algorithm,
                        full=full,
                        world=world,
                        model="q96-L4" if (algorithm in ("grpo", "sft")) == (world == 1) else "l128-L3",
                        gc=full != (algorithm in ("ppo", "dpo")),
                        # full fine-tuning: the planner's own choice reduce-scatters every micro-batch; the
                        # default deferral (every unsharded fp32 gradient held) on two of them
                        defer=world == 2 and (not full or algorithm in ("ppo", "dpo")),
                    )
                )
    return out


#: Full fine-tuning on 2 ranks, where its terms were first checked: 48 + 48 tokens, micro-batches of 2.
DEVELOPMENT = [
    dict(algorithm=a, full=True, world=2, model="q128-L3", gc=True, defer=d, set="development")
    for a, d in (("grpo", False), ("grpo", True), ("sft", True), ("dpo", True))
]
#: A tied head fully fine-tuned: one device, and 2 ranks resharded after forward (deferred sync off
#: and on, each algorithm with a loss over a sequence) and kept gathered (reshard_after_forward=False).
TIED = [
    dict(algorithm="grpo", full=True, world=1, model="t128-L4", gc=True, defer=False, set="tied"),
    *(
        dict(algorithm=a, full=True, world=2, model="t128-L4", gc=True, defer=d, set="tied")
        for a, d in (("grpo", False), ("grpo", True), ("sft", True), ("dpo", True))
    ),
    dict(algorithm="grpo", full=True, world=2, model="t128-L4", gc=True, defer=False, reshard=False, set="tied"),
]
CONFIGS = _configs() + DEVELOPMENT + TIED


def request_for(c: dict, device: str) -> ProbeRequest:
    # 8 sequences a step: 4 prompts x 2 completions (GRPO, LLMPPO), 8 examples (SFT), 4 pairs (DPO)
    per = {"grpo": 2, "ppo": 2, "sft": 1, "dpo": 2}[c["algorithm"]]
    development = c.get("set") == "development"
    tokens = 48 if development else 64
    workload = Workload(
        algorithm=c["algorithm"],
        full_finetune=c["full"],
        prompts_per_step=8 // per,
        **({"group_size": per} if c["algorithm"] in ("grpo", "ppo") else {}),
        prompt_tokens=tokens,
        completion_tokens=tokens,
        micro_batch_size_per_gpu=8 // c["world"] // 2,  # 2 a rank
        logprob_chunk_size=64 if development else 128,
        gradient_checkpointing=c["gc"],
        lora_rank=8,
        lora_alpha=16,
        lora_dropout=0.0,
        weights_dtype="bfloat16",
        attn_implementation="sdpa",
        generation="none",
        padded_batches=False,
        share_prompt_prefix=False,
    )
    fsdp = (
        FSDPConfig(
            param_dtype="bfloat16",
            reduce_dtype="float32",
            param_persistence_threshold=0,
            defer_grad_sync=c["defer"],
            reshard_after_forward=c.get("reshard", True),
        )
        if c["world"] > 1
        else None
    )
    return ProbeRequest(
        model=MODELS[c["model"]],
        workload=workload,
        fsdp=fsdp,
        nproc=c["world"],
        device=device,
        timed_steps=1,
        timeout_s=900,
    )


def report(results: dict, device: str) -> None:
    mib = 2**20
    coefficients = saved_coefficients(device)
    print(f"\nEvery algorithm ({device}, bf16): measured vs estimated per-rank peak, MiB")
    print(
        f"{'algorithm':9} {'train':5} {'model':8} {'gpus':>4} {'ckpt':>4} {'defer':>5} {'reshard':>7} "
        + " ".join(f"{ph + ' m/e':>17} {'err':>6}" for ph in PHASES)
    )
    errors: dict[str, list[float]] = {}
    for c in CONFIGS:
        req = request_for(c, device)
        rec = results.get(cache_key(req))
        if rec is None:
            continue
        est = estimate_request(req, coefficients)
        row = (
            f"{c['algorithm']:9} {'full' if c['full'] else 'lora':5} {c['model']:8} {c['world']:>4} "
            f"{'on' if c['gc'] else 'off':>4} {('yes' if c['defer'] else 'no') if c['world'] > 1 else '-':>5}"
            f" {('on' if c.get('reshard', True) else 'off') if c['world'] > 1 else '-':>7}"
        )
        for ph in PHASES:
            if ph not in rec["phases"] or ph not in est.phases:
                row += f" {'-':>17} {'':>6}"
                continue
            measured, guess = rec["phases"][ph]["total"], est.phases[ph].total
            err = (guess - measured) / measured
            if ph != "step":
                keys = (
                    ("development",)
                    if c.get("set") == "development"
                    else ("all", c["algorithm"], "full" if c["full"] else "lora", *(("tied",) if c.get("set") else ()))
                )
                for key in keys:
                    errors.setdefault(key, []).append(abs(err))
            row += f" {measured / mib:8.2f}/{guess / mib:<8.2f} {err:+6.1%}"
        print(row)
    print()
    for key in ("all", "lora", "full", *ALGORITHMS, "tied", "development"):
        if key in errors:
            e = errors[key]
            print(
                f"reference + learn, {key:11}: mean |error| {sum(e) / len(e):.2%}, max {max(e):.2%} over {len(e)} "
                "phase peaks"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rerun", action="store_true", help="ignore cached measurements")
    args = parser.parse_args()
    cache = ROOT / "benchmarks" / "results" / f"algorithms_{args.device}.json"
    results = measure_cached(
        CONFIGS, lambda c: request_for(c, args.device), cache=cache, rerun=args.rerun, phases=PHASES
    )
    report(results, args.device)


if __name__ == "__main__":
    main()
