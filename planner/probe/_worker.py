"""Rank side of a probe: ``torchrun ... -m planner.probe._worker REQUEST.json OUT_DIR``.

Builds the real trainer of the requested algorithm (GRPO and those on its loop,
LLMPPO, SFT, DPO; LoRA or full fine-tuning) for the requested workload and
FSDPConfig, runs real learn() steps on synthetic batches of exactly the
requested shapes (rollouts, or SFT examples and DPO pairs; and one real
generation when asked), and writes this rank's measurement to
``OUT_DIR/rank<r>.json``:

- step 1 warms up (lazy init, optimizer state) untracked;
- step 2 runs with one memory tracker per phase;
- the remaining steps are timed untracked.

``stages`` in the measurement says where the rank's seconds went: ``setup`` (from the
interpreter's start: imports, the process group), ``load``, ``warmup`` (step 1, a rollout
included), ``measured`` (step 2), ``timed`` (the rest).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

_STARTED = time.monotonic()  # the worker's clock starts with its module, before torch is imported


def _write(out_dir: Path, rank: int, payload: dict) -> None:
    tmp = out_dir / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(payload))
    tmp.rename(out_dir / f"rank{rank}.json")


def main() -> None:
    from agilerl.utils.cli import show_logs
    from agilerl.utils.lifetime import die_with_parent

    die_with_parent()  # the launcher (torchrun) dying, even by SIGKILL, ends this rank
    with show_logs("stdout", "agilerl", "planner"):  # the trainer's lines, in the worker log as before
        _main()


def _main() -> None:
    request = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    rank = int(os.environ.get("RANK", 0))
    result: dict = {
        "rank": rank,
        "node": int(os.environ.get("GROUP_RANK", 0)),
        "phases": {},
        "ok": False,
        "oom": False,
        "oom_phase": None,
        "error": None,
    }
    current = {"phase": "load"}
    try:
        _run(request, result, current, out_dir)
        result["ok"] = True
    except Exception as err:  # reported to the parent, which decides what failed
        import torch

        if isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower():
            result["oom"] = True
            result["oom_phase"] = current["phase"]
        result["error"] = traceback.format_exc()[-8000:]
    _write(out_dir, rank, result)
    if not result["ok"]:
        os._exit(1)  # do not wait in collectives other ranks will never join


def _run(request: dict, result: dict, current: dict, out_dir: Path) -> None:
    import torch

    from agilerl.distributed import FSDPConfig, get_world_size, init_distributed
    from planner.probe.gloo import settle_fsdp_collectives
    from planner.probe.tracking import PhaseRecorder, device_of
    from planner.workload import OFFLINE_SEQUENCES, Workload

    torch.set_num_threads(int(os.environ.get("AGILERL_PROBE_THREADS", "1")))
    init_distributed(timeout_seconds=int(request.get("collective_timeout_s", 120)))
    workload = Workload.model_validate(request["workload"])
    fsdp = FSDPConfig.model_validate(request["fsdp"]) if request.get("fsdp") is not None else None
    device = request["device"]
    budget = request.get("memory_budget_bytes")
    if device == "cuda" and budget:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
    result["world_size"] = get_world_size()

    stages = result.setdefault("stages", {})
    mark = [time.monotonic()]
    stages["setup"] = mark[0] - _STARTED

    def lap(name: str) -> None:
        now = time.monotonic()
        stages[name] = now - mark[0]
        mark[0] = now

    algorithm, kwargs = _algorithm_and_arguments(request, workload, fsdp)
    components = request.get("components")
    components = device != "cuda" if components is None else components
    agent = _load(algorithm, request["model"], kwargs, result, track=components)
    settle_fsdp_collectives(agent.model, agent.reference_model)
    lap("load")
    dev = device_of(agent.model)
    recorder = PhaseRecorder(
        agent.model, agent.optimizer, dev, enabled=False, reference=agent.reference_model, components=components
    )
    fault = _fault_injection(result["rank"])
    stall = _fault_injection(result["rank"], "AGILERL_PROBE_STALL")

    def observe(name):
        current["phase"] = name
        if fault == name:
            os.kill(os.getpid(), 9)  # testing: die the way an OOM-killed process dies
        if stall == name:
            time.sleep(3600)  # testing: a probe reliably in flight until it is stopped
        return recorder(name)

    agent.phase_observer = observe
    gen = torch.Generator().manual_seed(1234 + result["rank"])
    experiences = _synthetic_batches(agent, workload, gen)

    def rollout():
        p_len, c_len = workload.prompt_tokens, workload.completion_tokens
        vocab = _vocab_size(agent)
        prompts = {
            "input_ids": torch.randint(3, vocab, (workload.prompts_per_step, p_len), generator=gen),
            "attention_mask": torch.ones(workload.prompts_per_step, p_len, dtype=torch.long),
        }
        if agent.engine is None:
            # No EOS token: every completion runs its full length, as the worst case of a run does,
            # with no min-length processor beside the sampling (it holds about three more copies
            # of the logits than the trainer's own sampling).
            agent.generation_kwargs["eos_token_id"] = None
        else:
            agent.generation_kwargs["min_new_tokens"] = c_len  # exactly the requested length
        ids, masks = agent.get_action(prompts)
        assert ids.shape[1] == p_len + c_len, ids.shape
        if agent.engine is not None:
            result["engine"] = agent.engine.memory_report()

    generate = request.get("generate", False) and workload.algorithm not in OFFLINE_SEQUENCES
    # Step 1: warm-up, untracked.
    if generate:
        rollout()
    agent.learn(experiences())
    lap("warmup")
    # Step 2: one tracker per phase.
    recorder.enabled = True
    if generate:
        rollout()
    agent.learn(experiences())
    lap("measured")
    if request.get("save", False):
        with tempfile.TemporaryDirectory() as tmp:
            agent.save_checkpoint(tmp)
    recorder.enabled = False
    result["phases"].update(recorder.peaks)
    result["moe_rows"] = _moe_rows(agent.model)
    host = _host_state_bytes(agent)
    if host:
        for record in result["phases"].values():
            record["host_optimizer_state"] = host
    result["step_seconds"] = _timed_steps(agent, experiences, device, int(request.get("timed_steps", 3)), current)
    lap("timed")
    result["tokens_per_step"] = workload.completions_per_step * workload.sequence_tokens
    if budget:
        over = {
            name: rec.get("cuda_max_allocated", rec["total"])
            for name, rec in result["phases"].items()
            if rec.get("cuda_max_allocated", rec["total"]) > budget
        }
        result["over_budget_phases"] = over
    torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None


def _algorithm_and_arguments(request: dict, workload, fsdp) -> tuple[type, dict]:
    """The algorithm class the workload names and its arguments, as a user's run passes them."""
    from peft import LoraConfig

    import agilerl.algorithms
    from planner.workload import ALGORITHM_CLASSES, OFFLINE_SEQUENCES

    lora = (
        None
        if workload.full_finetune
        else LoraConfig(
            r=workload.lora_rank,
            lora_alpha=workload.lora_alpha,
            lora_dropout=workload.lora_dropout,
            target_modules=list(workload.lora_targets)
            if isinstance(workload.lora_targets, (list, tuple))
            else workload.lora_targets,
            task_type="CAUSAL_LM",
        )
    )
    algorithm = getattr(agilerl.algorithms, ALGORITHM_CLASSES[workload.algorithm])
    kwargs = dict(
        pad_token_id=0,
        pad_token="<pad>",
        lora_config=lora,
        batch_size=workload.prompts_per_step,
        micro_batch_size_per_gpu=workload.micro_batch_size_per_gpu,
        logprob_chunk_size=workload.logprob_chunk_size,
        gradient_checkpointing=bool(workload.gradient_checkpointing),
        load_in_4bit=workload.load_in_4bit,
        fsdp_config=fsdp,
        device=request["device"],
        dtype=workload.weights_dtype,
        share_prompt_prefix=workload.share_prompt_prefix,
        attn_implementation=workload.attn_implementation,
        seed=request.get("seed", 0),
        lr=1e-4,
    )
    if workload.algorithm != "sft":
        kwargs.update(beta=workload.beta, use_separate_reference_adapter=workload.use_separate_reference_adapter)
    if workload.algorithm not in OFFLINE_SEQUENCES:
        kwargs.update(
            group_size=workload.group_size,
            update_epochs=workload.update_epochs,
            temperature=workload.temperature,
            max_output_tokens=workload.completion_tokens,
            gather_weights_for_rollout=bool(workload.gather_weights_for_rollout),
        )
    if workload.generation == "vllm" and request.get("generate", False):
        from agilerl.utils.algo_utils import VLLMConfig

        kwargs.update(
            vllm_config=VLLMConfig(**workload.vllm_settings()),
            offload_weights_during_rollout=workload.offload_weights_during_rollout,
            max_model_len=workload.sequence_tokens,
        )  # the engine's too, unless vllm_max_model_len
    return algorithm, kwargs


def _load(algorithm: type, model: str, kwargs: dict, result: dict, *, track: bool = True):
    """Build the agent (under a tracker when ``track``) and record the load phase: host peak, the
    tracker's device peak, the model's and the reference's parameter bytes (CUDA's peaks on a GPU)."""
    import contextlib

    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from planner.probe.tracking import device_of, host_peak_bytes, host_peak_reset, param_bytes

    host_peak_reset()
    on_cuda = kwargs["device"] == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    load_tracker = MemTracker() if track else None
    start = time.perf_counter()
    with load_tracker or contextlib.nullcontext():
        agent = algorithm(model, **kwargs)
    result["load_seconds"] = time.perf_counter() - start
    dev = device_of(agent.model)
    peak = load_tracker.get_tracker_snapshot("peak").get(dev, {}).get("Total", 0) if load_tracker else 0
    load = {"host_peak": host_peak_bytes(), "tracker_total": int(peak)}
    load.update(param_bytes(agent.model))
    reference = param_bytes(agent.reference_model) if agent.reference_model is not None else {}
    if reference:
        load["reference_weights"] = sum(reference.values())
    load["total"] = max(load["tracker_total"], sum(param_bytes(agent.model).values()) + sum(reference.values()))
    if on_cuda:
        load["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
        load["cuda_max_reserved"] = torch.cuda.max_memory_reserved()
    result["phases"]["load"] = load
    result["param_bytes"] = param_bytes(agent.model)
    result["micro_batch_size_per_gpu"] = agent.micro_batch_size_per_gpu
    result["logprob_chunk_size"] = agent.logprob_chunk_size
    return agent


def _vocab_size(agent) -> int:
    from agilerl.utils.logprobs import causal_lm

    return int(causal_lm(agent.model).config.vocab_size)


def _synthetic_batches(agent, workload, gen):
    """A function making one step's batch for this rank, of random tokens shaped as the
    workload says: a rollout's (ids, masks, rewards), SFT's examples or DPO's pairs."""
    import torch

    from planner.workload import OFFLINE_SEQUENCES

    vocab = _vocab_size(agent)
    p_len, c_len = workload.prompt_tokens, workload.completion_tokens
    n_local = workload.completions_per_rank(agent.data_parallel_ranks)
    pad = agent.pad_token_id

    def experiences():
        ids = torch.randint(3, vocab, (n_local, p_len + c_len), generator=gen)
        masks = torch.zeros_like(ids)
        masks[:, p_len:] = 1
        if workload.padded_batches and n_local > 1:
            # A realistic spread: prompts of 1/2 to all of p_len tokens, left-padded, and completions
            # of 1 to c_len tokens, right-padded after they end; the first row keeps both whole (the
            # batch's width is the longest row's, as in a real rollout).
            prompt = torch.randint((p_len + 1) // 2, p_len + 1, (n_local,), generator=gen)
            completion = torch.randint(1, c_len + 1, (n_local,), generator=gen)
            prompt[0], completion[0] = p_len, c_len
            cols = torch.arange(p_len + c_len)
            left = cols[None, :] < (p_len - prompt)[:, None]
            right = cols[None, :] >= (p_len + completion)[:, None]
            ids[left | right] = pad
            masks[right] = 0
        if workload.share_prompt_prefix:
            # As a real rollout: the rows of a group share their (left-padded) prompt. A rank's rows
            # start at a multiple of its share, so group g's rows are the consecutive ones of prompt g.
            group = (agent.data_parallel_rank * n_local + torch.arange(n_local)) // workload.group_size
            head = torch.searchsorted(group, group)  # each row's group's first local row
            ids[:, :p_len] = ids[head, :p_len]
        rewards = torch.rand(n_local, generator=gen)
        if workload.algorithm not in OFFLINE_SEQUENCES:
            return ids, masks, rewards
        # SFT's examples, DPO's pairs (consecutive rows: a group of two shares its prompt), with the
        # attention the trainer derives for a rollout: the completion and the prompt's real tokens.
        prompt_region = masks.cumsum(dim=1) == 0
        attention = (masks.bool() | (prompt_region & (ids != pad))).long()
        batch = {"input_ids": ids, "attention_mask": attention, "completion_mask": masks}
        if workload.algorithm == "sft":
            return batch
        return {f"{side}_{k}": v[i::2] for k, v in batch.items() for i, side in enumerate(("chosen", "rejected"))}

    return experiences


def _timed_steps(agent, experiences, device: str, steps: int, current: dict) -> list[float]:
    """Seconds of ``steps`` untracked learn steps (the batch made before the clock starts)."""
    import torch

    seconds = []
    for _ in range(steps):
        batch = experiences()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        current["phase"] = "learn"
        agent.learn(batch)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    return seconds


def _moe_rows(model) -> dict[str, float]:
    """Routed rows this rank's experts computed per token block: the largest block and the mean
    (row-wise experts only; empty otherwise). Their ratio across ranks is the load imbalance."""
    from agilerl.distributed import moe_layout

    layout = moe_layout(model)
    if layout is None or not layout.layers:
        return {}
    stats = layout.stats()
    blocks = sum(s.num_token_blocks for s in stats)
    return {
        "max_block": float(max(s.max_rows_received for s in stats)),
        "mean_block": sum(s.num_rows_received for s in stats) / max(1, blocks),
    }


def _fault_injection(rank: int, variable: str = "AGILERL_PROBE_KILL") -> str | None:
    """For tests: ``AGILERL_PROBE_KILL=RANK:PHASE`` kills that rank on entering the phase,
    ``AGILERL_PROBE_STALL=RANK:PHASE`` makes it sleep there until it is stopped."""
    spec = os.environ.get(variable)
    if not spec:
        return None
    target, _, phase = spec.partition(":")
    return phase if int(target) == rank else None


def _host_state_bytes(agent) -> int:
    from agilerl.distributed import CPUOffloadAdamW

    opt = agent.optimizer
    if not isinstance(opt, CPUOffloadAdamW):
        return 0
    return sum(t.numel() * t.element_size() for t in opt.host_tensors())


if __name__ == "__main__":
    main()
