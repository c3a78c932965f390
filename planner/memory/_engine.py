"""A rollout engine on a rank of its own (agilerl.utils.remote_engine): its one GPU's memory.

An objective with a rollout planned with nothing generating on the trainer GPUs
(``generation='none'``) gets engine ranks of their own, one per node (planner.emit writes
``training.rollout_engines_per_agent``). Each runs :class:`~agilerl.utils.remote_engine.HFGenerateEngine`:
the whole model, unsharded, in the weights' dtype (no adapters: the trainer sends merged
weights, copied into it in place), and Hugging Face generate over its share of the step's
completions. Its memory is the rollout phase of that run on one GPU, counted by the same terms
as a trainer's Hugging Face rollout (:func:`._phases.rollout_phases`), with only the model's
weights held beside it.
"""

from __future__ import annotations

import dataclasses

from ..hardware import Cluster
from ..spec import ModelSpec
from ..workload import OFFLINE_SEQUENCES, Workload
from ._coefficients import Coefficients
from ._context import build_context
from ._overheads import host_process_bytes
from ._phases import rollout_phases, shared_terms
from ._result import Estimate, PhaseEstimate
from ._static import load_host_checkpoint_bytes
from ._units import build_layout


def engine_rank_count(workload: Workload, cluster: Cluster) -> int:
    """Engine ranks a run launches beside its trainer ranks: one per node for an objective with a
    rollout planned with ``generation='none'``, else none."""
    return cluster.num_nodes if workload.generation == "none" and workload.algorithm not in OFFLINE_SEQUENCES else 0


def engine_completions(workload: Workload, cluster: Cluster) -> int:
    """Completions the busiest engine rank generates at once: the step's completions in contiguous
    shares over the engine ranks (remote_engine._share; even, since they split over the trainer
    ranks, whole nodes of them); 0 without engine ranks."""
    engines = engine_rank_count(workload, cluster)
    return -(-workload.completions_per_step // engines) if engines else 0


def ranks_per_node(cluster: Cluster, engines: int) -> int:
    """The ranks every node launches (``--nproc-per-node``): its GPUs' trainer ranks and its share
    of ``engines`` engine ranks, one per node."""
    return cluster.per_node + engines // cluster.num_nodes


def node_ranks(cluster: Cluster, engines: int) -> list[tuple[int, int]]:
    """(trainer ranks, engine ranks) on each node, first node first, as ``agilerl-train`` places
    them: every node launches :func:`ranks_per_node` ranks (planner.emit.launch_command),
    torchrun gives each node the next block of ranks, and a member's engine ranks come after its
    trainer ranks (agilerl.manifest.RankLayout). On several nodes the trainers spill one rank a node
    past their GPUs' share, so the engine ranks fill the last node(s): two nodes of 8 hold 9 + 0
    and 7 + 2; four nodes of 2 hold 3 + 0, 3 + 0, 2 + 1 and 0 + 3."""
    per = ranks_per_node(cluster, engines)
    trainers = cluster.num_gpus
    out = []
    for node in range(cluster.num_nodes):
        here = max(0, min(per, trainers - node * per))
        out.append((here, per - here))
    return out


def node_host_bytes(est: Estimate, workload: Workload, cluster: Cluster, engine: PhaseEstimate | None) -> int:
    """The busiest node's host memory: its trainer ranks' (:meth:`Estimate.node_host_bytes`; rank 0
    on the first node) and, beside them, each engine rank's peak (``engine``, None where the
    trainers are planned alone) (its process and the model it
    loads: :func:`engine_rank_estimate`). The engine ranks load as the trainers start, so their
    peaks are added to the trainers' highest, not to one phase's: an upper bound by at most the
    trainers' start-up terms."""
    return _busiest_node(est, workload, cluster, engine)[1]


def node_host_phase(est: Estimate, workload: Workload, cluster: Cluster, engine: PhaseEstimate | None) -> str:
    """The trainers' phase where the busiest node's host memory (:func:`node_host_bytes`) peaks;
    "" on a node of engine ranks alone (they load as the trainers start, and hold it)."""
    trainers, rank0 = _busiest_node(est, workload, cluster, engine)[0]
    return est.node_host_phase(trainers, rank0=rank0) if trainers else ""


def _busiest_node(
    est: Estimate, workload: Workload, cluster: Cluster, engine: PhaseEstimate | None
) -> tuple[tuple[int, bool], int]:
    """((its trainer ranks, whether it holds rank 0), its host bytes) of the busiest node."""
    engines = engine_rank_count(workload, cluster) if engine is not None else 0
    each = engine.host_total if engine is not None else 0
    return max(
        (
            ((trainers, node == 0), est.node_host_bytes(trainers, rank0=node == 0) + engines_here * each)
            for node, (trainers, engines_here) in enumerate(node_ranks(cluster, engines))
        ),
        key=lambda item: item[1],
    )


def engine_rank_estimate(
    spec: ModelSpec, workload: Workload, cluster: Cluster, *, coefficients: Coefficients | None = None
) -> PhaseEstimate | None:
    """The busiest engine rank's memory on its GPU (one of ``cluster``'s kind), None where the run
    has no engine ranks. Nothing the planner chooses for the trainers changes it.

    The engine's run is the workload on one GPU with Hugging Face generate over
    :func:`engine_completions` rows of one prompt each (the trainers send every completion's
    prompt; the engine runs no shared-prefix prefill), the whole model in ``weights_dtype``
    (QLoRA's trainers send dequantised merged weights: the engine holds no 4-bit copy), no adapters,
    in the attention the trainers use (agilerl.train passes it), with the GPU overheads of one
    GPU whose one thread runs matmuls (its cuBLAS workspaces: no autograd thread). Its host holds
    the process and, while it loads, the whole model (HFGenerateEngine loads on the host, then
    moves it).
    """
    rows = engine_completions(workload, cluster)
    if not rows:
        return None
    engine = workload.model_copy(
        update={
            "generation": "hf",
            "prompts_per_step": rows,
            "group_size": 1,
            "share_prompt_prefix": False,
            "full_finetune": True,  # no adapters, nothing trained
            "load_in_4bit": False,
            "use_separate_reference_adapter": False,
            "gather_weights_for_rollout": None,
            "offload_weights_during_rollout": False,
            "micro_batch_size_per_gpu": None,
            # nothing but generate runs there: no reference or sampling-policy pass whose
            # logits tiles would cache a backward thread's cuBLAS workspaces
            "algorithm": "grpo",
            "beta": 0.0,
            "update_epochs": 1,
        }
    )
    one = cluster.model_copy(update={"num_gpus": 1, "gpus_per_node": None})
    ctx = build_context(spec, engine, one, None, coefficients=coefficients or Coefficients())
    layout = build_layout(ctx)
    terms = dataclasses.replace(
        shared_terms(ctx, layout),
        static={"weights": spec.total_params * ctx.weight_bytes},
        # from_pretrained builds the model on the host before it moves to the GPU: the whole
        # checkpoint there, as an unsharded trainer loads it
        host={"host_process": host_process_bytes(ctx), "host_checkpoint": load_host_checkpoint_bytes(ctx, layout)},
        matmul_threads=1,  # generate runs no backward: no autograd thread's workspaces
    )
    return rollout_phases(ctx, terms)["rollout"]
