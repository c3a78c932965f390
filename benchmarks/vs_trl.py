"""This project's GRPO step against Hugging Face TRL's ``GRPOTrainer``, on the same CPU work.

    pip install -e ".[bench]"            # TRL; never a runtime dependency
    python -m benchmarks.vs_trl [--pairs 5] [--steps 3] [--dtype float32] [--gradient-checkpointing]
    python -m benchmarks.vs_trl --ranks 2   # also: FSDP2 against data parallel on 2 gloo ranks
    python -m benchmarks.vs_trl --ranks 2 --ranks-only --fsdp-config default   # FSDP2 as FSDPConfig()

Both trainers get the same tiny random 4-layer Qwen2 (hidden 256, written once to a local
directory), the same character tokenizer object, LoRA r=16 on every linear (dropout 0), the
same batch (2 prompts x 8 completions, 64 prompt tokens, exactly 64 new tokens: ``min_new_tokens``
keeps an early end-of-sequence from shortening one side), beta 0.04 (a reference pass by
disabled adapters in both), one update per batch, AdamW, SDPA attention, the same dtype and
checkpointing setting, and one thread (``OMP_NUM_THREADS=1``). Rewards are the same cheap
function of the decoded text.

Each run is a fresh process that builds its trainer, takes one warm-up step and then
``--steps`` timed steps; a pair is one run of each, in alternating order, and every ratio is
taken pair by pair (the median is printed), so drift of the machine hits both sides alike.
Phases: ``generation`` (Hugging Face generate with its tokenising and decoding), ``reference``
(the no-grad reference log-probs), ``learn`` (forward, backward and optimizer step); ``step``
is the whole iteration, rewards and advantages included. Peak RSS is the process's
``ru_maxrss``.

This trainer runs with its defaults where the comparison allows: ``gather_weights_for_rollout``
is "auto" (the memory estimate turns it on here: generate runs on merged LoRA copies, or under
FSDP2 on units gathered once).

With ``--ranks 2`` it also runs this trainer on 2 gloo ranks under torchrun, data parallel
against FSDP2, on the same global batch (8 completions per rank), and prints the FSDP2/DP ratio.
FSDP2 runs with the FSDPConfig the planner picks for this run (``agilerl-plan MODEL --gpus 2
--sharding fsdp``: what a user who asks for FSDP2 and leaves its fields to the estimate gets),
or with ``--fsdp-config default`` as ``FSDPConfig()`` (every unit resharded after its forward).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MODEL = (
    "tiny:qwen2?hidden_size=256&intermediate_size=512&num_layers=4&num_heads=4&num_kv_heads=2&initializer_range=0.05"
)
PROMPTS, GROUP, PROMPT_TOKENS, NEW_TOKENS, RANK, BETA, LR = 2, 8, 64, 64, 16, 0.04, 1e-5
PHASES = ("step", "generation", "reference", "learn")


def _prompts(n: int) -> list[str]:
    # Character tokenizer: one token per character, so each prompt is exactly PROMPT_TOKENS tokens.
    base = "what is 12 + 30? answer with digits only, then stop. ok: "
    return [(f"{i:03d} " + base * 3)[:PROMPT_TOKENS] for i in range(n)]


def _reward(text: str) -> float:
    return float(sum(ch.isdigit() for ch in text)) / max(1, len(text))


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")


def _model_dir() -> str:
    from agilerl.algorithms.core.loading import resolve_model_source

    return resolve_model_source(MODEL)


def _finish(times: dict[str, list[float]]) -> dict:
    out = {k: statistics.median(v) for k, v in times.items()}
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


# -- this project's trainer ---------------------------------------------------------------------
def planned_fsdp_config(dtype: str, checkpointing: bool, world: int):
    """The FSDPConfig the planner picks for this very run under FSDP2 (``agilerl-plan MODEL
    --gpus 2 --sharding fsdp`` with the run's workload): what a user who asks for FSDP2 and
    leaves its fields to the estimate gets."""
    from agilerl.algorithms.core.autoplan import visible_cluster
    from planner.calibration import coefficients_for
    from planner.choose import plan
    from planner.models import load_model_spec
    from planner.workload import Workload

    workload = Workload(
        prompts_per_step=PROMPTS,
        group_size=GROUP,
        prompt_tokens=PROMPT_TOKENS,
        completion_tokens=NEW_TOKENS,
        micro_batch_size_per_gpu=GROUP * PROMPTS // world,
        gradient_checkpointing=checkpointing,
        lora_rank=RANK,
        lora_alpha=2 * RANK,
        lora_dropout=0.0,  # as _lora_config
        lora_targets="all-linear",
        beta=BETA,
        weights_dtype=dtype,
    )
    cluster = visible_cluster(world)
    result = plan(
        load_model_spec(MODEL, lora_targets="all-linear"),
        workload,
        cluster,
        sharding="fsdp",
        fixed={"param_dtype": dtype},
        coefficients=coefficients_for(cluster.gpu),
    )
    return result.fsdp


def run_ours(steps: int, dtype: str, checkpointing: bool, fsdp: str | None = None) -> dict:
    """``fsdp``: None (data parallel, or one process), "planned" (the planner's FSDPConfig for
    this run) or "default" (``FSDPConfig()`` with the run's dtype)."""
    import contextlib

    import torch

    from agilerl.algorithms import GRPO
    from agilerl.algorithms.core.loading import load_tokenizer
    from agilerl.distributed import FSDPConfig, barrier, init_distributed, is_main_process

    init_distributed()
    source = _model_dir()
    tokenizer = load_tokenizer(source)
    if fsdp == "planned":
        config = planned_fsdp_config(dtype, checkpointing, int(os.environ.get("WORLD_SIZE", "1")))
    else:
        config = FSDPConfig(param_dtype=dtype, reduce_dtype="float32") if fsdp == "default" else None
    agent = GRPO(
        source,
        tokenizer=tokenizer,
        pad_token_id=tokenizer.pad_token_id,
        pad_token=tokenizer.pad_token,
        lora_config=_lora(),
        batch_size=PROMPTS,
        group_size=GROUP,
        max_output_tokens=NEW_TOKENS,
        beta=BETA,
        lr=LR,
        dtype=dtype,
        device="cpu",
        attn_implementation="sdpa",
        gradient_checkpointing=checkpointing,
        fsdp_config=config,
        seed=0,
    )
    agent.generation_kwargs["min_new_tokens"] = NEW_TOKENS
    spent: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - start

    agent.phase_observer = timed
    times: dict[str, list[float]] = {k: [] for k in PHASES}
    prompts = _prompts(PROMPTS * (steps + 1))
    for i in range(steps + 1):
        spent.clear()
        barrier()
        start = time.perf_counter()
        ids, masks = agent.get_action(prompts[i * PROMPTS : (i + 1) * PROMPTS])
        texts = [tokenizer.decode(row[m.bool()], skip_special_tokens=True) for row, m in zip(ids, masks)]
        agent.learn((ids, masks, torch.tensor([_reward(t) for t in texts])))
        barrier()
        if i == 0:
            continue  # warm-up
        times["step"].append(time.perf_counter() - start)
        times["generation"].append(spent.get("rollout", 0.0))
        times["reference"].append(spent.get("reference", 0.0))
        times["learn"].append(spent.get("learn", 0.0) + spent.get("step", 0.0))
    assert int(masks.sum(dim=1).min()) == NEW_TOKENS, "completions came out shorter than NEW_TOKENS"
    result = _finish(times)
    result["gather_weights_for_rollout"] = agent.gather_weights_for_rollout  # "auto", as the estimate chose
    if config is not None:
        default = FSDPConfig().model_dump(mode="json")
        result["fsdp_config"] = {k: v for k, v in config.model_dump(mode="json").items() if v != default[k]}
    return result if is_main_process() else {}


# -- TRL -----------------------------------------------------------------------------------------
def run_trl(steps: int, dtype: str, checkpointing: bool) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from agilerl.algorithms.core.loading import load_tokenizer

    source = _model_dir()
    tokenizer = load_tokenizer(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    args = GRPOConfig(
        output_dir=os.environ.get("TMPDIR", "/tmp") + f"/vs_trl_{os.getpid()}",
        per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP,
        max_completion_length=NEW_TOKENS,
        generation_kwargs={"min_new_tokens": NEW_TOKENS},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=BETA,
        learning_rate=LR,
        max_grad_norm=1.0,
        num_iterations=1,
        gradient_checkpointing=checkpointing,
        max_steps=steps + 1,
        logging_steps=10_000,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=dtype == "bfloat16",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    dataset = Dataset.from_dict({"prompt": _prompts(PROMPTS * (steps + 1))})

    def reward(completions, **_):
        return [_reward(c) for c in completions]

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=_lora(),
    )
    spent: dict[str, float] = {}

    def wrap(name: str, fn, only_no_grad: bool = False):
        def inner(*a, **k):
            if only_no_grad and torch.is_grad_enabled():
                return fn(*a, **k)
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start

        return inner

    trainer._generate = wrap("generation", trainer._generate)
    trainer._generate_and_score_completions = wrap("prepare", trainer._generate_and_score_completions)
    trainer._get_per_token_logps_and_entropies = wrap(
        "reference", trainer._get_per_token_logps_and_entropies, only_no_grad=True
    )
    times: dict[str, list[float]] = {k: [] for k in PHASES}
    lengths: list[int] = []

    class Clock(TrainerCallback):
        start = 0.0

        def on_step_begin(self, *_, **__):
            spent.clear()
            Clock.start = time.perf_counter()

        def on_step_end(self, _args, state, *_, **__):
            if state.global_step <= 1:
                return  # warm-up
            step = time.perf_counter() - Clock.start
            times["step"].append(step)
            times["generation"].append(spent.get("generation", 0.0))
            times["reference"].append(spent.get("reference", 0.0))
            times["learn"].append(step - spent.get("prepare", 0.0))

    trainer.add_callback(Clock())
    original = trainer._generate

    def count(prompts):
        out = original(prompts)
        lengths.extend(len(c) for c in out[1])  # (prompt_ids, completion_ids, ...)
        return out

    trainer._generate = count
    trainer.train()
    assert min(lengths) == NEW_TOKENS, f"TRL completions came out shorter than {NEW_TOKENS}: {min(lengths)}"
    return _finish(times)


# -- driver --------------------------------------------------------------------------------------
def _spawn(which: str, args, ranks: int = 1) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    worker = [
        "-m",
        "benchmarks.vs_trl",
        "--worker",
        which,
        "--steps",
        str(args.steps),
        "--dtype",
        args.dtype,
        "--fsdp-config",
        args.fsdp_config,
    ]
    if args.gradient_checkpointing:
        worker.append("--gradient-checkpointing")
    if ranks > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(ranks),
            "--master_port",
            str(29500 + os.getpid() % 1000),
            *worker,
        ]
    else:
        cmd = [sys.executable, *worker]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{which} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def _table(title: str, names: tuple[str, str], runs: dict[str, list[dict]]) -> None:
    a, b = names
    print(f"\n{title}")
    print(f"{'':<12}{a:>12}{b:>12}{'ratio ' + a + '/' + b:>22}   per pair")
    for key in (*PHASES, "peak_rss_mib"):
        ratios = [x[key] / y[key] for x, y in zip(runs[a], runs[b]) if y[key] > 0]
        unit = " MiB" if key == "peak_rss_mib" else " s"
        ma = statistics.median(r[key] for r in runs[a])
        mb = statistics.median(r[key] for r in runs[b])
        label = "peak RSS" if key == "peak_rss_mib" else key
        fmt = ".0f" if key == "peak_rss_mib" else ".3f"
        ratio = f"{statistics.median(ratios):.2f}x" if ratios else "-"
        pairs = " ".join(f"{r:.2f}" for r in ratios)
        print(f"{label:<12}{format(ma, fmt) + unit:>12}{format(mb, fmt) + unit:>12}{ratio:>22}   {pairs}")


def _machine() -> str:
    name = "unknown CPU"
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run, after one warm-up step")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--gradient-checkpointing", action="store_true", help="on in both trainers (default off)")
    parser.add_argument("--ranks", type=int, default=1, help="2: also FSDP2 against data parallel on 2 gloo ranks")
    parser.add_argument(
        "--fsdp-config",
        default="planned",
        choices=["planned", "default"],
        help="FSDP2 side of --ranks: the planner's FSDPConfig for this run (default), "
        "or FSDPConfig() with the run's dtype",
    )
    parser.add_argument("--ranks-only", action="store_true", help="with --ranks: only FSDP2 against data parallel")
    parser.add_argument("--worker", choices=["ours", "trl", "dp", "fsdp"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run = {
            "ours": lambda: run_ours(args.steps, args.dtype, args.gradient_checkpointing),
            "trl": lambda: run_trl(args.steps, args.dtype, args.gradient_checkpointing),
            "dp": lambda: run_ours(args.steps, args.dtype, args.gradient_checkpointing),
            "fsdp": lambda: run_ours(args.steps, args.dtype, args.gradient_checkpointing, fsdp=args.fsdp_config),
        }
        result = run[args.worker]()
        if result:
            print("RESULT " + json.dumps(result), flush=True)
        return
    try:
        import trl
    except ImportError:
        raise SystemExit('TRL is not installed: pip install -e ".[bench]"') from None
    import torch
    import transformers

    _model_dir()  # written once, before the timed processes
    print(f"machine: {_machine()}")
    print(
        f"{MODEL.split('?')[0]} h256 L4, LoRA r={RANK}, {PROMPTS} prompts x {GROUP} completions, "
        f"{PROMPT_TOKENS} + {NEW_TOKENS} tokens, {args.dtype}, checkpointing "
        f"{'on' if args.gradient_checkpointing else 'off'}, OMP_NUM_THREADS=1; torch {torch.__version__}, "
        f"transformers {transformers.__version__}, trl {trl.__version__}; {args.pairs} pairs x {args.steps} steps"
    )
    runs: dict[str, list[dict]] = {"agilerl": [], "trl": []}
    for i in range(0 if args.ranks_only and args.ranks > 1 else args.pairs):
        for name in ("agilerl", "trl") if i % 2 == 0 else ("trl", "agilerl"):
            runs[name].append(_spawn("ours" if name == "agilerl" else "trl", args))
            print(f"  pair {i + 1} {name}: step {runs[name][-1]['step']:.3f} s", flush=True)
    if runs["agilerl"]:
        _table("one process, median seconds per step", ("agilerl", "trl"), runs)
    if args.ranks > 1:
        runs = {"fsdp2": [], "dp": []}
        for i in range(args.pairs):
            for name in ("fsdp2", "dp") if i % 2 == 0 else ("dp", "fsdp2"):
                runs[name].append(_spawn("fsdp" if name == "fsdp2" else "dp", args, ranks=args.ranks))
                print(f"  pair {i + 1} {name}: step {runs[name][-1]['step']:.3f} s", flush=True)
        chosen = ", ".join(f"{k}={v}" for k, v in runs["fsdp2"][0].get("fsdp_config", {}).items())
        _table(
            f"this trainer on {args.ranks} gloo ranks (the same global batch), median seconds per step; "
            f"FSDP2 with the {args.fsdp_config} FSDPConfig ({chosen or 'all defaults'})",
            ("fsdp2", "dp"),
            runs,
        )


if __name__ == "__main__":
    main()
