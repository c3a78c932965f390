"""Train from a manifest: ``python -m agilerl.train manifest.yaml [--device cpu|cuda]``.

On N ranks: ``agilerl-train --nproc-per-node=N manifest.yaml`` (:mod:`agilerl.launch`, which
checks the launch before starting any rank and says a rank's error in one line), or
``torchrun --nproc_per_node=N -m agilerl.train manifest.yaml``. The N
ranks split into the population's members, each with ``training.training_gpus_per_agent``
trainer ranks (by default its share of the launched ranks) and
``training.rollout_engines_per_agent`` engine ranks: member m trains on ranks of its own
(FSDP2 shards and data parallel within them), its engines serve its rollouts. A member given
every rank (``training_gpus_per_agent`` = N, no engines) shares them with the others, which
train in turn.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

from agilerl.utils.cli import ArgumentParser, cannot_write_in, positive_int, quiet_bitsandbytes, show_logs

__all__ = ["main", "train", "check_launch", "refuse", "LAUNCHER_ENV", "REFUSALS_ENV", "ERROR_SOURCE"]

#: Set (to its name) by :mod:`agilerl.launch` for the ranks it starts: a rank's error then goes
#: to its torchrun error file only, and the launcher says it once for all the ranks.
LAUNCHER_ENV = "AGILERL_LAUNCHER"
#: Set by :mod:`agilerl.launch` (with ``--max-restarts``) to a folder of its own: a rank that
#: stops on bad input leaves its line there, and the ranks of a restart say it again at once
#: (bad input does not change between attempts) rather than load the model to find it again.
REFUSALS_ENV = "AGILERL_REFUSALS"
#: Whether this process has trained a step: a ValueError after one is not bad input a restart
#: would meet again (a peer lost mid-step, say), so it is not left for the restarts.
_stepped = False
#: What :func:`refuse` writes as ``source`` in a rank's torchrun error file (telling its line
#: from a crash's record).
ERROR_SOURCE = "agilerl.train"

#: Named, not ``__name__``: under ``python -m agilerl.train`` this module is ``__main__``.
logger = logging.getLogger("agilerl.train")


def _log(msg: str, level: int = logging.INFO) -> None:
    """Log ``msg`` on the main process (the other ranks train the same steps)."""
    from agilerl.distributed import is_main_process

    if is_main_process():
        logger.log(level, "%s", msg)


def refuse(prog: str, message: str, *, again: bool = False) -> int:
    """Say why the run stops, in one line, and return exit status 2.

    The line is written whole, in one write: the ranks of a launch share a terminal, and a
    line written in two pieces interleaves with another rank's. Under torchrun the rank also
    writes it to its error file (``TORCHELASTIC_ERROR_FILE``, a JSON ``message``), where
    torchrun's failure report and :mod:`agilerl.launch` read it; under :mod:`agilerl.launch`
    (``LAUNCHER_ENV`` set) that file is the only place, and the launcher says it once.
    Unless ``again`` (a failure a restart may not meet: the rollout engine's start, anything
    once a step has been trained), it is also left for the ranks of a restart on this node
    (``REFUSALS_ENV``), which then stop on it at once.
    """
    line = " ".join(message.split())
    refusals = os.environ.get(REFUSALS_ENV)
    if refusals and line and not again:
        said = _refusal_file(refusals)
        try:  # whole or not at all: torchrun may stop this rank mid-write
            said.with_suffix(".part").write_text(line)
            os.replace(said.with_suffix(".part"), said)
        except OSError:
            pass  # the restart then finds it the long way
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            record = {"message": line, "timestamp": int(time.time()), "source": ERROR_SOURCE}
            Path(error_file).write_text(json.dumps(record))
        except OSError:
            error_file = None  # said on stderr below instead
    if not (error_file and os.environ.get(LAUNCHER_ENV)):
        sys.stderr.write(f"{prog}: error: {line}\n")
        sys.stderr.flush()
    return 2


def check_launch(manifest, *, device: str | None = None, world: int | None = None) -> None:
    """Raise ValueError, before anything heavy runs, when this launch cannot train ``manifest``.

    The ranks launched must be ``training.training_gpus_per_agent``; FSDP2 needs
    torchrun (a process group) and a layout the ranks can take; the checkpoints
    must have a directory to go to; the model must be loadable (a local
    directory, a valid tiny model, the local Hugging Face cache, or a reachable
    hub); members sharing the ranks must fit in memory together; ``--device
    cuda`` needs a GPU. ``world``: the ranks about to be launched (a launcher
    checks before starting them); by default the ranks of this launch
    (torchrun's ``WORLD_SIZE``; one without it).
    """
    from agilerl.utils.sources import check_model_source

    training, algo = manifest.training, manifest.algorithm
    launched = world is not None or "WORLD_SIZE" in os.environ
    world = world if world is not None else int(os.environ.get("WORLD_SIZE", "1"))
    layout = manifest.layout(world)  # ValueError naming the launch the manifest needs
    fsdp = algo.fsdp_config()
    if fsdp is not None and fsdp != "auto" and not launched:  # "auto" on one device plans unsharded
        raise ValueError(
            "algorithm.fsdp shards the model with FSDP2, which needs a process group: run `agilerl-train "
            f"--nproc-per-node={layout.trainers} ...`, or set fsdp: false for one device"
        )
    if fsdp is not None and fsdp != "auto":
        fsdp.check_world(layout.trainers)
    micro = algo.micro_batch_size_per_gpu
    data_parallel = layout.trainers // (fsdp.tp if fsdp is not None and fsdp != "auto" else 1)
    per_rank = training.rollout_batch_size * algo.sequences_per_prompt // data_parallel
    if micro is not None and per_rank % micro:
        raise ValueError(
            f"algorithm.micro_batch_size_per_gpu={micro} does not divide a trainer rank's {per_rank} "
            f"completions (rollout_batch_size x group_size over {data_parallel} data-parallel ranks)"
        )
    if training.checkpoint_dir:
        _check_checkpoint_dir(Path(training.checkpoint_dir))
    from agilerl.algorithms.core.loading import attention_problem

    if problem := attention_problem(algo.attn_implementation):
        raise ValueError(f"algorithm.{problem}")
    config = check_model_source(algo.model_name, allow_download=True)
    if layout.shared and layout.members > 1 and config is not None:
        _check_shared_population(
            members=layout.members, config=config, dtype=algo.dtype, memory_bytes=_launch_memory_bytes(device, world)
        )
    if algo.vllm is not None:
        from agilerl.utils.engine import EngineError, check_vllm_installed

        try:
            check_vllm_installed()
        except EngineError as err:
            raise ValueError(f"algorithm.vllm: {err}") from None
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda, but no CUDA device is available here; use --device cpu")


def _check_shared_population(*, members: int, config: dict, dtype: str, memory_bytes: int) -> None:
    """Raise ValueError when ``members`` population members sharing the launched ranks cannot all
    be built: they are, before the first step, each with its own copy of the model.

    The bound is a floor, so it never refuses a population that fits: each member's token
    embedding alone, ``vocab_size x hidden_size`` weights in ``dtype`` (the layers, the adapters,
    the optimizer and the activations come on top), against ``memory_bytes``, all the memory the
    launch has (:func:`_launch_memory_bytes`).
    """
    from agilerl.utils.sources import text_config

    text = text_config(config)
    per_member = text["vocab_size"] * text["hidden_size"] * (4 if dtype == "float32" else 2)
    if members * per_member > memory_bytes:
        raise ValueError(
            f"training.population_size={members}: the members share the launched ranks, each with its own "
            f"model, and their token embeddings alone take {members} x {per_member:,} bytes = "
            f"{members * per_member / 2**30:,.1f} GiB, more than the {memory_bytes / 2**30:,.1f} GiB of memory "
            "of this launch: lower population_size, or launch ranks for every member"
        )


def _launch_memory_bytes(device: str | None, world: int) -> int:
    """All the memory the launched ranks could fill, counted generously (a bound it gives must
    never refuse a launch that fits): each rank's host's, and its GPU's where it trains on CUDA."""
    per_rank = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device != "cpu":
        import torch

        if torch.cuda.is_available():
            per_rank += max(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    return world * per_rank


def _check_checkpoint_dir(folder: Path) -> None:
    """Raise ValueError when no checkpoint could be written under ``folder``: it, or the nearest of
    its parents that exists, is not a directory, or that directory is not writable."""
    try:
        existing = next(p for p in (folder, *folder.parents) if p.exists())  # the root, or '.', exists
    except OSError as err:  # a name too long for a path, say
        raise ValueError(f"training.checkpoint_dir: {folder} cannot be used: {err.strerror or err}") from None
    if not existing.is_dir():
        where = "is a file" if existing == folder else f"is under {existing}, which is a file"
        raise ValueError(f"training.checkpoint_dir: {folder} {where}, not a directory")
    if why := cannot_write_in(existing):
        raise ValueError(f"training.checkpoint_dir: cannot write in {existing} ({why}; checkpoints go under {folder})")


def train(manifest, *, device: str | None = None, max_steps: int | None = None) -> list[list[dict[str, float]]]:
    """Run the manifest; return the per-step metrics of each population member this rank trains
    (its own member's, on a member's ranks; every member's when they share the ranks; none on an
    engine rank)."""
    from agilerl.distributed import use_rank_group

    try:
        return _train(manifest, device=device, max_steps=max_steps)
    finally:
        use_rank_group(None)  # the process's helpers act on every rank again


def _train(manifest, *, device: str | None, max_steps: int | None) -> list[list[dict[str, float]]]:
    global _stepped
    _stepped = False
    import torch

    from agilerl.distributed import get_world_size, init_distributed
    from agilerl.utils.arithmetic_env import ArithmeticEnv
    from agilerl.utils.utils import create_population

    check_launch(manifest, device=device)
    init_distributed()
    world = get_world_size()
    training, algo = manifest.training, manifest.algorithm
    steps = max_steps or training.max_steps
    layout = manifest.layout(world)
    from agilerl.distributed import get_rank, use_rank_group

    member, serves, trainers, engines = layout.of(get_rank())
    torch.manual_seed(training.seed)
    from agilerl.algorithms.core.loading import load_tokenizer, resolve_model_source

    source = algo.model_name
    if layout.engines:  # engine ranks load it: every rank, before they split (a built-in model is written once)
        source = resolve_model_source(source)
    tokenizer = load_tokenizer(source)  # a built-in model's needs nothing written
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    kwargs = dict(
        model_name=algo.model_name,
        pad_token_id=tokenizer.pad_token_id,
        pad_token=tokenizer.pad_token,
        tokenizer=tokenizer,
        lora_config=manifest.lora.to_peft() if manifest.lora is not None else None,
        batch_size=training.rollout_batch_size,
        **algo.algorithm_kwargs(),
        max_grad_norm=algo.max_grad_norm,
        max_model_len=algo.max_model_len,
        micro_batch_size_per_gpu=algo.micro_batch_size_per_gpu,
        logprob_chunk_size=algo.logprob_chunk_size,
        gradient_checkpointing=algo.gradient_checkpointing,
        load_in_4bit=algo.load_in_4bit,
        share_prompt_prefix=algo.share_prompt_prefix,
        fsdp_config=algo.fsdp_config(),
        dtype=algo.dtype,
        attn_implementation=algo.attn_implementation,
        seed=training.seed,
    )
    if algo.name != "SFT":
        kwargs["use_separate_reference_adapter"] = algo.use_separate_reference_adapter
    if not algo.offline:
        kwargs.update(
            temperature=algo.temperature,
            max_output_tokens=algo.max_output_tokens,
            vllm_config=algo.vllm,
            offload_weights_during_rollout=algo.offload_weights_during_rollout,
            gather_weights_for_rollout=algo.gather_weights_for_rollout,
        )
    start = time.monotonic()
    remote = None
    ranks = None
    if engines:  # first, on every rank of the member: its groups are made in the same order (engine_ranks)
        from agilerl.utils.remote_engine import RemoteEngine, engine_ranks

        ranks = engine_ranks(trainers, engines)
        if serves:
            return _serve(ranks, algo, source, tokenizer, device)
    if not layout.shared:
        use_rank_group(trainers)  # the helpers, the collectives and FSDP2's mesh: this member's trainer ranks
    if ranks is not None:
        remote = kwargs["rollout_engine"] = RemoteEngine(ranks)
    if layout.shared:
        population = create_population(algo.name, {}, training.population_size, algo_kwargs=kwargs, device=device)
    else:
        population = create_population(
            algo.name, {}, 1, algo_kwargs={**kwargs, "seed": training.seed + member}, device=device
        )
        population[0].index = member
    where = (
        f"{world} rank(s)"
        if layout.shared
        else f"ranks {trainers[0]}-{trainers[-1]}" + (f" (engines on {engines[0]}-{engines[-1]})" if engines else "")
    )
    _log(f"built {len(population)} {algo.name} agent(s) on {where} in {time.monotonic() - start:.1f}s")
    histories: list[list[dict[str, float]]] = []
    for agent in population:
        env = ArithmeticEnv(seed=training.seed + agent.index, operators=manifest.environment.operators)
        folder = Path(training.checkpoint_dir) / f"agent{agent.index}" if training.checkpoint_dir else None
        history: list[dict[str, float]] = []
        resumed = _resume(agent, env, folder) if folder is not None else None
        if resumed is not None:
            history, resumed_from = resumed
            _log(f"agent {agent.index}: resumed at step {agent.steps} from {resumed_from}")
        trained = False
        for step in range(agent.steps + 1, steps + 1):
            metrics = _step(agent, env, algo.name, training.rollout_batch_size)
            trained = _stepped = True
            history.append(metrics)
            if step == 1 or step % training.log_every == 0 or step == steps:
                _log(f"agent {agent.index} step {step:4d}  {_metrics_line(metrics)}")
            if (
                folder is not None
                and training.checkpoint_interval
                and step % training.checkpoint_interval == 0
                and step < steps
            ):
                saved = _save(agent, env, history, folder / f"{STEP_PREFIX}{step:08d}")
                _log(f"agent {agent.index}: checkpoint {saved}")
                _prune(folder, training.keep_checkpoints)
        histories.append(history)
        if resumed is not None and not trained and resumed_from == folder:  # the final checkpoint is this state
            beyond = f", beyond max_steps {steps}" if agent.steps > steps else ""
            _log(
                f"agent {agent.index}: the checkpoint is at step {agent.steps}{beyond}, so there is nothing to "
                "train (raise training.max_steps, or --max-steps, to train on)"
            )
        elif folder is not None:
            path = _save(agent, env, history, folder)
            _log(f"saved {path}")
        if history:
            _summary(agent.index, history)
    if remote is not None:
        remote.stop()
    _log(f"done in {time.monotonic() - start:.1f}s")
    return histories


def _serve(ranks, algo, source: str, tokenizer, device: str | None) -> list:
    """An engine rank: a rollout engine for its member's trainer ranks, until they stop it."""
    from agilerl.distributed import resolve_device

    # Hugging Face generate (the manifest refuses algorithm.vllm with engines on ranks of their own)
    from agilerl.utils.remote_engine import HFGenerateEngine, serve_rollout_engine

    engine = HFGenerateEngine(
        source,
        dtype=algo.dtype,
        device=resolve_device(device),
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation=algo.attn_implementation,  # the trainers' (the planner counts its generate in it)
    )

    served = serve_rollout_engine(engine, ranks)
    logger.info("engine rank %s: served %d rollouts", ranks.engines, served)
    return []


def _step(agent, env, name: str, prompts_per_step: int) -> dict[str, float]:
    """One training step of ``agent`` on the environment's next prompts: a rollout scored by the
    environment's reward (the RL objectives), or this rank's share of the prompts with their
    answers (SFT) and a wrong answer as the rejected completion (DPO)."""
    import torch

    prompts, answers = env.sample(prompts_per_step)
    if name in ("SFT", "DPO"):
        wrong = env.wrong_answers(answers) if name == "DPO" else None
        mine = agent.local_examples(len(prompts))
        if name == "SFT":
            return agent.learn(agent.encode(prompts[mine], answers[mine]))
        return agent.learn(agent.encode(prompts[mine], answers[mine], wrong[mine]))
    ids, masks = agent.get_action(prompts)
    local = agent.local_slice(len(prompts))
    texts, stopped = _decode(agent, ids, masks)
    my_answers = [answers[i // agent.group_size] for i in range(local.start, local.stop)]
    rewards = torch.tensor(env.reward(texts, my_answers, stopped))
    return agent.learn((ids, masks, rewards))


#: What a step's log line shows, where the algorithm reports it.
_LOGGED = (
    ("mean_reward", "reward {:.3f}"),
    ("loss", "loss {:+.4f}"),
    ("kl", "kl {:.4f}"),
    ("reward_margin", "margin {:+.3f}"),
    ("reward_accuracy", "acc {:.2f}"),
    ("value_loss", "vloss {:.4f}"),
    ("completion_length", "len {:.2f}"),
)


def _metrics_line(metrics: dict[str, float]) -> str:
    return "  ".join(fmt.format(metrics[key]) for key, fmt in _LOGGED if key in metrics)


#: Periodic checkpoints are ``agent<i>/step-<8 digits>/attributes.pt``; the final one is ``agent<i>/attributes.pt``.
STEP_PREFIX = "step-"


def _save(agent, env, history, path: Path) -> Path:
    """A checkpoint with the data position (the environment's RNG) and the metrics so far."""
    return agent.save_checkpoint(path, extra={"env_rng": env.get_state(), "history": history})


def _checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints under ``folder``, newest step first (written atomically: a file is whole)."""
    from agilerl.algorithms.core.base import CHECKPOINT_FILE

    found = [
        d
        for d in folder.glob(f"{STEP_PREFIX}*")
        if d.name[len(STEP_PREFIX) :].isdigit() and (d / CHECKPOINT_FILE).is_file()
    ]
    steps = {d: int(d.name[len(STEP_PREFIX) :]) for d in found}
    final = folder / CHECKPOINT_FILE
    if final.is_file():  # an earlier run's final checkpoint: its step is inside
        import torch

        try:
            steps[folder] = int(torch.load(final, map_location="cpu", weights_only=False, mmap=True).get("steps", 0))
        except Exception:  # noqa: BLE001 - unreadable: try it last, _resume reports it
            steps[folder] = -1
    return sorted(steps, key=lambda d: (steps[d], d == folder), reverse=True)


def _resume(agent, env, folder: Path) -> tuple[list[dict[str, float]], Path] | None:
    """Load the newest checkpoint under ``folder`` that loads on every rank; its metrics history
    and its path (``folder`` itself for the final checkpoint), or None.

    The main rank lists the checkpoints and the ranks agree on each one before taking it: a file
    one rank cannot read (a torn copy, a shared file system failing on one node) is skipped by
    all of them, so no rank trains on from another step's shards, optimizer state or data.
    """
    import pickle

    from agilerl.algorithms.core.base import CheckpointMismatch
    from agilerl.distributed import allreduce_minmax_int, broadcast_object_list, get_rank, is_main_process

    loaded, damaged, foreign = 0, 1, 2
    candidates = broadcast_object_list([_checkpoints(folder) if folder.is_dir() else []])[0]
    applied = False  # this rank took a checkpoint another rank could not: its state is no longer step 0's
    for path in candidates:
        outcome, why, extra = loaded, "", {}
        try:
            extra = agent.load_checkpoint(path)
        except CheckpointMismatch as err:  # another run's: training here would prune its checkpoints
            outcome, why = foreign, str(err)
        except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as err:  # damaged: an older one
            outcome, why = damaged, f"{type(err).__name__}: {err}"
        if outcome == damaged and not is_main_process():  # the main rank says it below
            logger.warning("rank %d: cannot load checkpoint %s: %s", get_rank(), path, why)
        worst = allreduce_minmax_int(outcome)[1]
        if worst == foreign:
            raise ValueError(
                f"training.checkpoint_dir: {folder} holds another run's checkpoints "
                f"({why or 'found on another rank'}); resume them with their own manifest, "
                "or give this run a checkpoint_dir of its own"
            )
        if worst == damaged:
            applied = applied or outcome == loaded
            _log(
                f"agent {agent.index}: skipping checkpoint {path}: {why or 'another rank could not load it'}",
                logging.WARNING,
            )
            continue
        if "env_rng" in extra:
            env.set_state(extra["env_rng"])
        return list(extra.get("history", [])), path
    if allreduce_minmax_int(int(applied))[1]:  # some ranks hold a later step's state, the others none
        raise ValueError(
            f"training.checkpoint_dir: no checkpoint under {folder} loads on every rank, and some ranks "
            "loaded one the others could not; check the files each node reads (or move them away to start over)"
        )
    return None


def _prune(folder: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` periodic checkpoints (rank 0; the others wait)."""
    import shutil

    from agilerl.distributed import barrier, is_main_process

    if is_main_process():
        periodic = [p for p in _checkpoints(folder) if p != folder]
        for old in periodic[keep:]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()


def _decode(agent, ids, masks):
    eos = agent.eos_token_ids()
    texts, stopped = [], []
    for row, mask in zip(ids, masks):
        tokens = row[mask.bool()].tolist()
        stopped.append(bool(tokens) and tokens[-1] in eos)
        texts.append(agent.tokenizer.decode(tokens, skip_special_tokens=True))
    return texts, stopped


def _summary(index: int, history: list[dict[str, float]]) -> None:
    key = next(k for k in ("mean_reward", "reward_margin", "loss") if k in history[0])
    values = [m[key] for m in history]
    k = max(1, len(values) // 10)
    first, last = statistics.fmean(values[:k]), statistics.fmean(values[-k:])
    what = {"mean_reward": "mean reward", "reward_margin": "reward margin", "loss": "loss"}[key]
    _log(f"agent {index}: {what} over the first {k} steps {first:.3f}, over the last {k} steps {last:.3f}")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of a run: the manifest, ``--device`` and ``--max-steps`` (``agilerl-train``
    takes the same and hands them to its ranks)."""
    parser.add_argument("manifest", help="path to a manifest YAML")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default=None, help="compute device (default: cuda when available)"
    )
    parser.add_argument("--max-steps", type=positive_int, default=None, help="override training.max_steps")


def main(argv: list[str] | None = None, *, prog: str = "python -m agilerl.train") -> int:
    parser = ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    with show_logs("stdout", "agilerl"):  # the library's lines (the main rank's, and engine ranks') on stdout
        return _main(parser, args)


def _refusal_file(folder: str) -> Path:
    """Where this rank leaves its bad-input line for a restart (named by its local rank)."""
    return Path(folder) / f"rank{os.environ.get('LOCAL_RANK', '0')}"


def _refused_before() -> str | None:
    """In a restart under ``agilerl-train --max-restarts``: the line this rank (or, where it said
    none, another of this node's) stopped on in an earlier attempt, else None."""
    folder = os.environ.get(REFUSALS_ENV)
    if not folder or not int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
        return None
    own = _refusal_file(folder)
    said = [own] if own.is_file() else sorted(p for p in Path(folder).glob("rank*") if not p.suffix)
    return said[0].read_text() if said else None


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun rank: end with the launcher, even on its kill -9
        from agilerl.utils.lifetime import die_with_parent

        die_with_parent()
    if (line := _refused_before()) is not None:
        return refuse(parser.prog, line)
    from agilerl.manifest import load_manifest

    try:
        manifest = load_manifest(args.manifest)
        check_launch(manifest, device=args.device)
    except ValueError as err:  # ManifestError included
        return refuse(parser.prog, str(err))
    if not manifest.algorithm.load_in_4bit:
        quiet_bitsandbytes()
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    from agilerl.utils.engine import EngineError

    try:
        train(manifest, device=args.device, max_steps=args.max_steps)
    except EngineError as err:  # the rollout engine failed to start, or a sync did not match it
        # engine ranks of their own run Hugging Face generate (the manifest refuses vllm there)
        field = (
            "training.rollout_engines_per_agent" if manifest.training.rollout_engines_per_agent else "algorithm.vllm"
        )
        status = refuse(parser.prog, f"{field}: {err}", again=True)
    except ValueError as err:  # what an algorithm refuses at construction that the manifest let through
        status = refuse(parser.prog, str(err), again=_stepped)
    except KeyboardInterrupt:  # Ctrl-C, or the launcher stopping its ranks with SIGINT: no traceback
        if not os.environ.get(LAUNCHER_ENV):
            sys.stderr.write(f"{parser.prog}: interrupted\n")
        return 130
    else:
        status = 0
    # Refused too: a group left to the interpreter's exit could abort in C++ ("terminate called
    # without an active exception"), a line after the rank's own.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
