"""The phases of a training step, assembled from the terms: load, rollout (and vLLM's weight
sync), reference, learn, step, save. Peak is the largest phase. The
offline objectives (SFT, DPO) have no rollout; SFT has no reference pass either.

Within a phase components peak at different moments, so a phase is the larger of its
moments (each a full set of components at one instant), never the sum of their maxima.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ._activations import (
    gradients_in_flight,
    learn_activations,
    learn_mask_bytes,
    nograd_beside_bytes,
    reference_forward_moment,
    value_head_bytes,
)
from ._context import Context
from ._gathered import (
    Gathered,
    PostBackwardWindows,
    after_forward_bytes,
    backward_gathered_bytes,
    backward_layer_windows,
    between_steps_bytes,
    build_gathered,
    forward_windows,
    model_head_backward_bytes,
    nograd_gathered_bytes,
    post_backward_windows,
)
from ._generation import (
    VLLM_NOTE,
    hf_rollout_moments,
    host_vllm_weight_bytes,
    vllm_asleep_bytes,
    vllm_awake_bytes,
    vllm_outside_budget_bytes,
    vllm_weight_bytes,
)
from ._logits import (
    head_gradient_bytes,
    kept_logprob_bytes,
    learn_logits_bytes,
    model_head_gradient_bytes,
    reference_logits_bytes,
)
from ._overheads import CUBLAS_THREADS, gpu_overheads, host_process_bytes, learn_tile_segment_bytes
from ._result import Estimate, PhaseEstimate
from ._static import (
    FULL_NOTE,
    QLORA_NOTE,
    StaticMemory,
    gradient_terms,
    load_gathered_bytes,
    load_host_checkpoint_bytes,
    reduce_input_held_at_end,
    reduce_inputs_held,
    save_gathered_bytes,
    save_host_checkpoint_bytes,
    static_components,
    static_memory,
    step_optimizer_bytes,
    trainer_gathers_head,
)
from ._units import Layout, build_layout

Components = dict[str, int]


@dataclass(frozen=True, slots=True)
class Terms:
    """The terms several phases share."""

    layout: Layout
    memory: StaticMemory
    static: Components  # held in every phase
    host: Components  # host memory held in every phase
    gathered: Gathered
    nograd_first: int  # a no-grad forward's window, the first forward (it gathers the root): copy-outs included
    nograd_later: int  # ... in a no-grad forward that finds the root gathered (generate's later steps)
    after_forward: int  # what stays gathered after a forward
    vllm_asleep: int
    kept_logprobs: int  # per-token tensors kept from the no-grad passes through learn and the step
    kept_reference: int  # ... at the end of the no-grad passes
    #: threads that run matmuls once the first step has (each keeps its cuBLAS workspaces): the
    #: forward's and autograd's; 1 where only generate runs (an engine rank of its own)
    matmul_threads: int = CUBLAS_THREADS


def host_resident(ctx: Context, memory: StaticMemory) -> Components:
    """The host memory every phase holds: the process, offloaded optimizer state and
    weights, vLLM's offloaded weights."""
    host = {"host_process": host_process_bytes(ctx)}
    if memory.host_optimizer:
        host["host_optimizer_state"] = memory.host_optimizer
    if memory.host_weights:
        host["host_weights"] = memory.host_weights
    if memory.host_gradients:
        host["host_gradients"] = memory.host_gradients
    if memory.host_reference:
        host["host_reference_weights"] = memory.host_reference
    if ctx.workload.generation == "vllm" and ctx.workload.vllm_sleep_level == 1:
        host["host_vllm_weights"] = host_vllm_weight_bytes(ctx)
    return host


def shared_terms(ctx: Context, layout: Layout) -> Terms:
    memory = static_memory(ctx, layout)
    gathered = build_gathered(ctx, layout)
    return Terms(
        layout=layout,
        memory=memory,
        static=static_components(memory),
        host=host_resident(ctx, memory),
        gathered=gathered,
        nograd_first=nograd_gathered_bytes(ctx, gathered),
        nograd_later=nograd_gathered_bytes(ctx, gathered, first=False),
        after_forward=after_forward_bytes(ctx, gathered),
        vllm_asleep=vllm_asleep_bytes(ctx),
        kept_logprobs=kept_logprob_bytes(ctx),
        kept_reference=kept_logprob_bytes(ctx, "reference"),
    )


def make_phase(
    ctx: Context, terms: Terms, components: Components, host: Components | None = None, *, matmuls: bool = True
) -> PhaseEstimate:
    """A phase's non-zero components (as ints) with the GPU overheads on what they allocate
    (``matmuls``: the threads' cuBLAS workspaces are there, from the first step on)."""
    merged = {name: int(v) for name, v in components.items() if v}
    threads = terms.matmul_threads if matmuls else 0
    for name, v in gpu_overheads(ctx, merged, terms.layout, matmul_threads=threads).items():
        merged[name] = merged.get(name, 0) + v
    return PhaseEstimate(components=merged, host={**terms.host, **(host or {})})


def larger(*candidates: Components) -> Components:
    """The moment with the most bytes (the first on a tie)."""
    return max(candidates, key=lambda c: sum(c.values()))


def load_phase(ctx: Context, terms: Terms) -> PhaseEstimate:
    """Loading the weights: no optimizer state yet, a tensor at a time through the host."""
    return make_phase(
        ctx,
        terms,
        {**terms.static, "optimizer_state": 0, "weights_gathered": load_gathered_bytes(ctx, terms.layout)},
        {"host_checkpoint": load_host_checkpoint_bytes(ctx, terms.layout)},
        matmuls=False,
    )


def lora_fold_bytes(ctx: Context) -> int:
    """The transient of folding the actor's LoRA into a gathered base weight (FSDP2) or a merged
    copy (unsharded) with gather_weights_for_rollout (agilerl.algorithms.grpo): PEFT's delta ``s * B @ A`` of the
    widest sharded adapted linear, built twice over (the product, then its scaled copy) in the
    compute dtype on GPUs, in fp32 plus a cast back on CPUs. 0 where nothing is folded: no
    gather-once, tp > 1, QLoRA's 4-bit weights, LoRA on packed experts."""
    if not ctx.workload.gather_weights_for_rollout or ctx.tp > 1 or ctx.workload.load_in_4bit:
        return 0
    widest = 0
    for names, shapes in zip(ctx.lora_names, ctx.lora_shapes):
        for name, (_, a_cols, b_rows, _) in zip(names, shapes):
            if ":" not in name:  # folded into a gathered copy, or into a merged one (replicated, unsharded)
                widest = max(widest, a_cols * b_rows)
    per_element = 2 * ctx.compute_bytes if ctx.on_gpu else 2 * 4 + ctx.compute_bytes
    return widest * per_element


def merged_copy_bytes(ctx: Context) -> int:
    """With gather_weights_for_rollout (agilerl.algorithms.grpo): each adapted linear whose base
    weight is a plain tensor (every one unsharded; under FSDP2 those below the persistence
    threshold, kept replicated) runs generate on a new tensor ``W + s B A`` in the weights' dtype,
    beside ``W`` itself, from the fold to the end of the call. The sharded ones fold into their
    gathered copies instead (counted in the gathered window). 0 with QLoRA's 4-bit weights, for
    LoRA on packed experts (left unmerged) and with tp > 1 (nothing is merged)."""
    if not ctx.workload.gather_weights_for_rollout or ctx.workload.load_in_4bit or ctx.tp > 1:
        return 0
    return ctx.weight_bytes * sum(
        a_cols * b_rows
        for names, shapes in zip(ctx.lora_names, ctx.lora_shapes)
        for name, (_, a_cols, b_rows, _) in zip(names, shapes)
        if ":" not in name and (not ctx.sharded or a_cols * b_rows < ctx.persistence_threshold)
    )


def regathering(ctx: Context) -> tuple[bool, bool]:
    """Under reshard_after_forward=False, whether (the no-grad passes' first micro-batch, the
    learn phase's last micro-batch) finds the units resharded and gathers them again, each
    staying gathered once it has run (planner.memory._gathered.forward_unit_windows'
    ``regathers``), rather than finding them all gathered.

    FSDP2 reshards every unit after its backward; GRPO reshards them after a rollout and
    no-grad passes that gathered once (gather_weights_for_rollout), and a full fine-tune's
    reference copy after its pass. So the no-grad passes regather unless Hugging Face generate
    left the actor gathered, and the last learn micro-batch regathers unless it is the step's
    only one and a no-grad forward of the actor (generate, the reference pass with adapters off
    or its own adapter, the old-policy pass) left it gathered. Measured on 2 gloo ranks with an
    untied head and no rollout: the reference pass and learn peak at the head's copy-out, the
    head twice beside every unit and the last block's all-gather output (read 14.1% and 12.0%
    low as every unit gathered: tests/planner/probe/test_probe.py)."""
    workload = ctx.workload
    once = gathers_once(ctx)
    rollout_leaves = workload.generation == "hf" and not once
    actor_passes = workload.has_old_policy_pass or (workload.has_reference and not ctx.reference_copy)
    leaves = (actor_passes and not once) or (rollout_leaves and not actor_passes)
    nograd = not rollout_leaves or ctx.reference_copy
    learn = workload.update_epochs * ctx.micro_batches > 1 or not leaves
    return nograd, learn


def gathers_once(ctx: Context) -> bool:
    """Whether Hugging Face generate runs under FSDP2 with every unit gathered once
    (gather_weights_for_rollout: GRPO._gathered_for_rollout), which reshards them all after."""
    workload = ctx.workload
    return ctx.sharded and bool(workload.gather_weights_for_rollout) and workload.generation == "hf"


def _gathered_throughout(ctx: Context, terms: Terms) -> Callable[[int], int]:
    """A no-grad forward's window under gather_weights_for_rollout with Hugging Face generate
    (GRPO._gathered_for_rollout, and _gathered_for_reference for the no-grad passes): every unit
    stays gathered from its first forward to the end, and the unit being gathered holds its
    all-gather output beside its unsharded copy meanwhile. Otherwise the window as it is."""
    if not gathers_once(ctx):
        return lambda window: window
    floor = terms.gathered.all_bytes + terms.gathered.largest_bytes
    return lambda window: max(floor, window)


def rollout_phases(ctx: Context, terms: Terms) -> dict[str, PhaseEstimate]:
    """Generation: Hugging Face generate block after block (no-grad window), or vLLM awake,
    with its weight sync gathering one unit at a time."""
    match ctx.workload.generation:
        case "hf":
            # The prefill is the first forward, which gathers the root; the root stays gathered
            # through the steps after it (apply_fsdp2). A unit copies out before its block has made
            # anything: the prefill pairs a block's forward with the window while it runs, and a
            # copy-out with the cache of the layers before (a decode step's block holds little: any).
            # Under reshard_after_forward=False the prefill gathers the units the step before's
            # backward resharded, and each stays gathered once it has run.
            widen = _gathered_throughout(ctx, terms)
            merged = merged_copy_bytes(ctx)  # unsharded, or replicated under FSDP2: merged copies
            layers, head = forward_windows(ctx, terms.layout, terms.gathered, regathers=True)
            prefill, decode, sampling = hf_rollout_moments(
                ctx,
                terms.layout,
                tuple((widen(running), widen(copy) if copy else 0) for running, copy in layers),
                (widen(head[0]), widen(head[1])) if any(head) else (0, 0),
            )
            prefill["weights_gathered"] += merged
            # a unit's copy-out (the first's beside the root's all-gather output) or a unit outside
            # the blocks running, with the embedded prompts
            embedded = ctx.completions_per_rank * ctx.workload.prompt_tokens * ctx.carried_hidden * ctx.compute_bytes
            generating = larger(
                {**terms.static, "weights_gathered": widen(terms.nograd_first) + merged, "activations": embedded},
                {**terms.static, **prefill},
                {**terms.static, "weights_gathered": widen(terms.nograd_later) + merged, **decode},
                {
                    **terms.static,
                    "weights_gathered": widen(between_steps_bytes(ctx, terms.gathered)) + merged,
                    **sampling,
                },
            )
            # Before generating, GRPO folds the actor's LoRA into the gathered weights (or merged copies),
            # one linear at a time: everything gathered, no KV cache yet, and one delta being built.
            folded = merged + (terms.gathered.all_bytes if ctx.sharded else 0)
            folding = {**terms.static, "weights_gathered": folded + lora_fold_bytes(ctx)}
            return {
                "rollout": make_phase(ctx, terms, larger(generating, folding) if lora_fold_bytes(ctx) else generating)
            }
        case "vllm":
            awake, outside = vllm_awake_bytes(ctx), vllm_outside_budget_bytes(ctx)
            largest_unit = terms.gathered.largest_bytes if ctx.sharded else 0
            if not ctx.workload.offload_weights_during_rollout:
                return {
                    "rollout": make_phase(ctx, terms, {**terms.static, "vllm": awake + outside}),
                    "sync": make_phase(
                        ctx, terms, {**terms.static, "vllm": awake + outside, "weights_gathered": largest_unit}
                    ),
                }
            # The engine wakes its weights, takes the new ones while the trainer's are on the
            # device, then its KV cache once the trainer's weights (base and adapters) are on
            # the host.
            parked = {"weights": 0, "weights_replicated": 0, "lora": 0}
            host = {"host_weights": terms.host.get("host_weights", 0) + sum(terms.static.get(k, 0) for k in parked)}
            return {
                "rollout": make_phase(ctx, terms, {**terms.static, **parked, "vllm": awake + outside}, host),
                "sync": make_phase(
                    ctx, terms, {**terms.static, "vllm": vllm_weight_bytes(ctx), "weights_gathered": largest_unit}
                ),
            }
    return {}


def _left_by_rollout(ctx: Context, terms: Terms) -> int:
    """What the actor's rollout leaves gathered for the passes after it (full fine-tuning's
    reference is a model of its own, whose window runs beside it). Only Hugging Face generate under
    reshard_after_forward=False, without gathering once, leaves anything: every unit but the root.
    FSDP2's wrapper of generate (register_fsdp_forward_method) runs the root's post-forward once
    the nested forwards have left its group idle, so it reshards the root whatever its setting
    (traced on 2 gloo ranks: counted with the root, a tied head's reference pass read 6.3% high).
    Resharded after forward, every block unit reshards after its forward, and GRPO reshards the
    root itself (_gathered_for_rollout; counted gathered, that pass read 7.8% high); gathering once
    reshards every unit after; vLLM's weight sync reshards every unit first and then gathers one
    module at a time outside the units."""
    fsdp = ctx.fsdp
    if fsdp is None or fsdp.reshard_after_forward or ctx.workload.generation != "hf" or gathers_once(ctx):
        return 0
    return terms.after_forward - terms.gathered.root_bytes


def reference_phase(ctx: Context, terms: Terms) -> PhaseEstimate | None:
    """The no-grad passes per micro-batch (None without them): a block's forward, or the chunked head.

    The old-policy pass (update_epochs > 1; LLMPPO's sampling pass, with its value head,
    every step) runs the actor; the reference pass runs the base model with adapters disabled
    unless the reference is an adapter of its own, or full fine-tuning's frozen copy.
    """
    workload = ctx.workload
    if not (workload.has_reference or workload.has_old_policy_pass):
        return None
    adapters_on = workload.use_separate_reference_adapter or workload.has_old_policy_pass
    hidden = ctx.micro_batch * (ctx.sequence_tokens - ctx.prefix_split) * ctx.carried_hidden * ctx.compute_bytes
    # A unit copies out before its block runs (the first micro-batch's first unit beside the root's
    # all-gather output: that forward gathers the root, which stays gathered for the others); a
    # block's forward runs under the window held while it runs.
    gathered = _gathered_throughout(ctx, terms)
    actors = _left_by_rollout(ctx, terms) if ctx.reference_copy else 0

    def widen(window: int) -> int:
        return gathered(window) + actors

    # Full fine-tuning's frozen copy keeps its shards in the compute dtype: its all-gathers cast nothing.
    own = terms.gathered
    if ctx.reference_copy and not workload.has_old_policy_pass:
        own = build_gathered(ctx, terms.layout, casts=False)
    # Its first micro-batch may gather the units again (regathering), the later ones find them gathered.
    layers, head = forward_windows(
        ctx, terms.layout, own, regathers=regathering(ctx)[0], also_gathered=ctx.micro_batches > 1
    )
    fwd = reference_forward_moment(ctx, terms.layout, adapters_on, tuple(widen(running) for running, _ in layers))
    # a unit's copy-out, before its block has made anything (the head's after every block)
    copy_out = max((copy for _, copy in layers), default=0)
    copying = widen(max(copy_out, *head)) if layers else 0
    beside = nograd_beside_bytes(ctx, ctx.micro_batch, ctx.sequence_tokens - ctx.prefix_split)
    kept = terms.kept_reference
    return make_phase(
        ctx,
        terms,
        {
            **terms.static,
            "vllm": terms.vllm_asleep,
            **larger(
                {"weights_gathered": widen(nograd_gathered_bytes(ctx, own)), "activations": hidden + kept},
                {"weights_gathered": copying, "activations": beside + kept},
                {"weights_gathered": fwd.window, "activations": fwd.activations + kept},
                {
                    "weights_gathered": terms.after_forward,
                    "activations": hidden + kept,
                    "logits": reference_logits_bytes(ctx),
                },
                # LLMPPO: the value head over the scored positions' hidden states, in fp32
                {"weights_gathered": terms.after_forward, "activations": hidden + kept + value_head_bytes(ctx)},
            ),
        },
    )


def backward_gradients(layout: Layout, grads) -> tuple[int, ...]:
    """Per layer, how the held gradients have changed when that layer runs backward: through a
    trained lm_head's post-backward (or a tied head's gradient, held), then every later block
    unit's (:class:`._static.GradientTerms`, per block unit in order: new shards, or accumulated
    gradients given way to their shards); only the head's when the earlier micro-batches' shards
    take every reduce-scatter in place."""
    if not grads.per_unit:  # a tied head's gradient still changes them
        return (grads.head,) * len(layout.layer_units) if grads.head else ()
    after = [0] * len(grads.per_unit)
    for u in range(len(grads.per_unit) - 2, -1, -1):
        after[u] = after[u + 1] + grads.per_unit[u + 1]
    first = layout.layer_units[0]  # the block units are consecutive in layout.units
    return tuple(grads.head + after[k - first] for k in layout.layer_units)


def block_post_backward(grads, windows: PostBackwardWindows) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The widest block unit's post-backward as it starts (its gradient all made, the input the
    unit before kept) and as it reduce-scatters (:class:`._static.GradientTerms`), each as (the
    window gathered, the gradients beyond ``prior`` then, the reduce-scatter input alive): the
    changes of the units that reduce-scattered before it (the trained head's, the later
    blocks'), and its own. Zeros without FSDP."""
    entering, reducing, after = (0, 0, 0), (0, 0, 0), grads.head
    changes = grads.per_unit or (0,) * len(grads.unit_reducing)
    for change, (reduced, buffer), (made, before), window in zip(
        reversed(changes),
        reversed(grads.unit_reducing),
        reversed(grads.unit_entering),
        reversed(windows.block_reducing),
    ):
        entering = max(entering, (windows.block, after + made, before), key=sum)
        reducing = max(reducing, (window, after + reduced, buffer), key=sum)
        after += change
    return entering, reducing


def _head_reduce_moment(grads, window: int, activations: int) -> list[dict[str, int]]:
    """A trained untied lm_head unit's reduce-scatter, the chunked head's workspace freed: its
    gradient, the reduce-scatter's input and output, under ``window`` (traced on 2 gloo ranks);
    none without such a head, or where the trainer's head gathered and reduced its own copy
    (planner.memory._static.trainer_gathers_head)."""
    if not grads.head_buffer:
        return []
    return [
        {
            "weights_gathered": window,
            "gradients": grads.prior + grads.head_reducing + grads.head_output,
            "activations": activations,
            "comm_buffers": grads.head_buffer,
        }
    ]


def _model_head_backward_moment(ctx: Context, terms: Terms, prior: int, activations: int) -> list[dict[str, int]]:
    """The model's own one-position head running backward, where the trainer keeps it in the graph
    (not :func:`._static.trainer_gathers_head`): after the chunked head's backward, its workspace
    freed and its input's gradient beside (``activations``), under the window its logits' hook
    opens (:func:`._gathered.model_head_backward_bytes`) and with a trained head's gradients
    (:func:`._logits.model_head_gradient_bytes`)."""
    if trainer_gathers_head(ctx, terms.layout):
        return []
    return [
        {
            "weights_gathered": model_head_backward_bytes(ctx, terms.gathered),
            "gradients": prior,
            "activations": activations,
            "logits": model_head_gradient_bytes(ctx),
        }
    ]


def _embed_reduce_moment(terms: Terms, grads, reduced: int, activations: int) -> list[dict[str, int]]:
    """Trained embeddings' post-backward (full fine-tuning under FSDP2), the last: every other unit
    resharded in its own, and the embeddings' unit resharded before its reduce-scatter, so only
    the root stays gathered when the embeddings are a unit of their own (untied), nothing when
    they are the root's (tied). ``reduced``: the gradients held once every other unit has
    reduce-scattered, a tied head's summed gradient among them: by now the embeddings' own, which
    foreach_reduce frees once copied into the input (``embed_reducing``: under deferred sync their
    accumulated one too). Traced on 2 gloo ranks: a tied full fine-tune in one micro-batch, counted
    with the root gathered and its gradient alive, read 12.1% high. None otherwise."""
    if not grads.embed_buffer:
        return []
    layout = terms.layout
    in_root = any(t is layout.embed for t in layout.root.base)  # tied: the root holds the table
    return [
        {
            "weights_gathered": 0 if in_root else terms.gathered.root_bytes,
            "gradients": reduced - grads.tied_head + grads.embed_reducing,
            "activations": activations,
            "comm_buffers": grads.embed_buffer,
        }
    ]


def learn_phase(ctx: Context, terms: Terms) -> PhaseEstimate:
    """Forward + backward of one micro-batch (the last of the step).

    Components peak at different moments of a micro-batch, so the learn phase is the
    largest of them: the head's backward (every activation still kept, the logits workspace
    at its largest, a trained head's weight gradient); the model's own one-position head's backward
    after it, where the trainer keeps that head in the graph (the last block prefetched, a trained
    head's two gradients summed); in the forward, under its gathered
    windows (planner.memory._gathered.forward_layer_windows), a block's forward or its
    unit's copy-out (what the earlier blocks keep beside it), an untied lm_head unit's, and
    a checkpointed block's forward; a checkpointed block's recompute and a block's backward
    (under the backward's window, beside the reduce-scatter input FSDP2 still holds); a trained
    untied lm_head unit's post-backward, after the chunked head's workspace is freed; a block
    unit's post-backward (its unsharded gradients being reduce-scattered, which FSDP2 does once
    the unit's backward is done); the backward's end (every gradient made, the embeddings'
    last) and trained embeddings' post-backward (planner.memory._static.gradient_terms).
    """
    grads = gradient_terms(ctx, terms.layout, terms.memory)
    windows, head = forward_windows(ctx, terms.layout, terms.gathered, regathers=regathering(ctx)[1])
    head_window = max(head)
    backward_windows = backward_layer_windows(ctx, terms.layout, terms.gathered)
    held = reduce_inputs_held(ctx, terms.layout)
    # Every unit but the embeddings' (and the root's) through its post-backward; unsharded, where the
    # gradients are the fp32 masters' or the weights' own, every gradient of the step is an upper bound.
    reduced = grads.prior + grads.head + sum(grads.per_unit)
    if ctx.fsdp is None:
        reduced = max(reduced, grads.final)
    acts = learn_activations(
        ctx, terms.layout, backward_gradients(terms.layout, grads), windows, backward_windows, held
    )
    kept, backward = acts.kept, acts.backward
    hidden_grad = acts.head_rows * ctx.hidden_size * ctx.compute_bytes  # the head's input gradient
    window = backward_gathered_bytes(ctx, terms.gathered)
    reducing = post_backward_windows(ctx, terms.layout, terms.gathered)
    post_backward = block_post_backward(grads, reducing)
    # A padded batch's attention mask lives from the forward's start to the backward's end;
    # eager attention's own masks, without checkpointing, while the forward runs only.
    held_masks, forward_masks = learn_mask_bytes(ctx)
    beside = terms.kept_logprobs + held_masks
    value = value_head_bytes(ctx)  # LLMPPO: kept for backward, and its gradient at the head's
    flowing_in = gradients_in_flight(ctx, recompute=False, tokens=acts.head_rows)
    return make_phase(
        ctx,
        terms,
        {
            **terms.static,
            "vllm": terms.vllm_asleep,
            # reserved from the learn forward's head on, whichever moment peaks (GPU only)
            "allocator_slack": learn_tile_segment_bytes(ctx),
            **larger(
                {
                    "weights_gathered": terms.after_forward,
                    "gradients": grads.prior,
                    "activations": kept + hidden_grad + beside + 2 * value,
                    "logits": learn_logits_bytes(ctx, backward=True) + head_gradient_bytes(ctx),
                },
                *_model_head_backward_moment(ctx, terms, grads.prior, kept + hidden_grad + beside + 2 * value),
                *_head_reduce_moment(grads, reducing.head, kept + hidden_grad + beside + 2 * value),
                # a block's forward with grad, under the forward's gathered window (FSDP2 holds the running
                # unit's all-gather output beside its unsharded copy, and the next unit's in flight)
                *(
                    [
                        {
                            "weights_gathered": acts.forward_gathered,
                            "gradients": grads.prior,
                            "activations": acts.forward + beside + forward_masks + value,
                        }
                    ]
                    if acts.forward or acts.forward_gathered
                    else []
                ),
                # an untied lm_head's unit in the forward (the model's own head, over the last
                # position): every keep of the forward beside it, under its window (the head twice)
                *(
                    [
                        {
                            "weights_gathered": head_window,
                            "gradients": grads.prior,
                            "activations": kept + beside + forward_masks,
                            "logits": ctx.micro_batch * ctx.vocab_size * ctx.compute_bytes,
                        }
                    ]
                    if head_window
                    else []
                ),
                # a checkpointed block's recompute in backward
                {
                    "weights_gathered": acts.recompute_gathered or window,
                    "gradients": grads.prior + acts.recompute_grads,
                    "activations": acts.recompute + beside + value,
                    "comm_buffers": acts.recompute_reducing,
                },
                # a checkpointed block's forward with grad, under the forward's gathered window
                *(
                    [
                        {
                            "weights_gathered": acts.checkpointed_forward_gathered,
                            "gradients": grads.prior,
                            "activations": acts.checkpointed_forward + beside,
                        }
                    ]
                    if acts.checkpointed_forward
                    else []
                ),
                {
                    "weights_gathered": acts.backward_gathered or window,
                    "gradients": grads.prior + acts.backward_grads,
                    "activations": backward + beside + value,
                    "comm_buffers": acts.backward_reducing,
                },
                # a block unit's post-backward: its unsharded gradients and their reduce-scatter, once
                # its own activations are freed (what the blocks keep and the gradients flowing remain)
                *(
                    {
                        "weights_gathered": window,
                        "gradients": grads.prior + made,
                        "activations": acts.blocks_kept + acts.embedding_kept + flowing_in + beside,
                        "comm_buffers": buffer,
                    }
                    for window, made, buffer in post_backward
                ),
                # the end of the backward: every gradient of the step made, the embeddings' as it is made
                # (beside a tied head's summed gradient, and the sum of the two autograd makes)
                {
                    "weights_gathered": reducing.end,
                    "gradients": reduced + grads.embed + grads.tied_head,
                    "activations": acts.embedding_kept + flowing_in + beside,
                    "comm_buffers": reduce_input_held_at_end(ctx, terms.layout),  # the first block unit's
                },
                *_embed_reduce_moment(terms, grads, reduced, flowing_in + beside),
            ),
        },
    )


#: agilerl.distributed's data-parallel gradient average flattens at most this many bytes at once.
ALL_REDUCE_BUCKET_BYTES = 64 * 2**20


def step_phase(ctx: Context, terms: Terms) -> PhaseEstimate:
    """Clip and AdamW over the sharded gradients; data parallel first averages the gradients,
    a bucket of them flattened at a time."""
    memory = terms.memory
    bucket = 0
    if not ctx.sharded and ctx.data_parallel_ranks > 1:
        bucket = min(ALL_REDUCE_BUCKET_BYTES, memory.trainable_elements * 4)
    return make_phase(
        ctx,
        terms,
        {
            **terms.static,
            "vllm": terms.vllm_asleep,
            "gradients": memory.gradients_sharded,
            "comm_buffers": bucket,
            "optimizer_state": step_optimizer_bytes(ctx, memory),
        },
    )


def save_phase(ctx: Context, terms: Terms) -> PhaseEstimate:
    """The trained tensors gathered one at a time; rank 0 keeps them and the optimizer state on
    the host (on a CPU run the same memory: counted with the gathered weights)."""
    host = save_host_checkpoint_bytes(ctx, terms.memory)
    gathered = save_gathered_bytes(ctx, terms.layout) + (0 if ctx.on_gpu else host)
    return make_phase(
        ctx, terms, {**terms.static, "vllm": terms.vllm_asleep, "weights_gathered": gathered}, {"host_checkpoint": host}
    )


def assemble(ctx: Context) -> Estimate:
    """Every phase of the step from a built context."""
    terms = shared_terms(ctx, build_layout(ctx))
    phases = {"load": load_phase(ctx, terms), **rollout_phases(ctx, terms)}
    if (reference := reference_phase(ctx, terms)) is not None:
        phases["reference"] = reference
    phases["learn"] = learn_phase(ctx, terms)
    phases["step"] = step_phase(ctx, terms)
    phases["save"] = save_phase(ctx, terms)
    notes = (
        ([QLORA_NOTE] if ctx.workload.load_in_4bit else [])
        + ([FULL_NOTE] if ctx.full_finetune else [])
        + ([VLLM_NOTE] if ctx.workload.generation == "vllm" else [])
    )
    if ctx.workload.load_in_4bit and any(ctx.packed):
        notes.append(
            f"QLoRA: the packed routed experts stay in {ctx.workload.weights_dtype} (bitsandbytes "
            "quantises nn.Linear layers only)"
        )
    if ctx.spec.text_model_of:
        notes.append(
            f"the text model of {ctx.spec.text_model_of}: its vision/audio encoders are not counted; the "
            "trainer fine-tunes the exported text model (python -m agilerl.utils.text_model SOURCE OUT_DIR)"
        )
    return Estimate(
        phases=phases,
        capacity_bytes=ctx.cluster.gpu.memory_bytes,
        gpus_per_node=ctx.cluster.per_node,
        notes=tuple(notes),
    )
