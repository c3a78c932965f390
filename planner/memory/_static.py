"""Memory that stays put through the step: base weights, adapters, optimizer state, the
trained parameters' gradients, and full fine-tuning's frozen reference copy. Per rank, from
the FSDP layout.

PEFT keeps adapters in fp32 (4 bytes per element); AdamW keeps two fp32 moments per
trainable element and a step tensor per trainable tensor. Full fine-tuning
(agilerl.algorithms.core.base) trains every base parameter: under FSDP2 its shards are fp32
(4 bytes) with fp32 sharded gradients; unsharded the weights stay in the weights dtype and
MasterWeightAdamW keeps an fp32 master (4), an fp32 gradient (4) and the moments (8) beside
each.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._context import DTYPE_BYTES, Context
from ._units import Layout

#: What each 4-bit linear's quantisation state keeps whatever its size (bitsandbytes'
#: ``quantize_4bit`` with double quantisation): its 16-value fp32 NF4 code, its own copy of the
#: 256-value fp32 map that quantises its absmax, and the fp32 offset of that absmax.
NF4_STATE_FIXED_BYTES = 16 * 4 + 256 * 4 + 4


def nf4_state_bytes(values: int) -> int:
    """Bytes of one linear's NF4 quantisation state beside its packed weight (``values`` weights):
    a uint8 absmax per block of 64 values and an fp32 scale per 256 of those blocks, and the
    fixed part (:data:`NF4_STATE_FIXED_BYTES`). Counted from bitsandbytes 0.50's QuantState on a
    CPU probe (128 x 128: 1,352 bytes; 4096 x 4096: 267,332)."""
    blocks = -(-values // 64)
    return blocks + 4 * -(-blocks // 256) + NF4_STATE_FIXED_BYTES


QLORA_NOTE = "QLoRA: NF4 linears (embeddings, lm_head, norms and MoE routers kept in the weights dtype)"
FULL_NOTE = (
    "full fine-tuning: every parameter trains with fp32 master weights, gradients and AdamW moments"
    " (16 bytes a parameter beside the weights)"
)


@dataclass(frozen=True, slots=True)
class StaticMemory:
    weights: int  # base weights on the device (sharded, or all of them unsharded)
    weights_replicated: int  # tensors under the persistence threshold, whole on every rank
    lora_device: int  # adapters on the device (all copies)
    optimizer_device: int  # AdamW's moments (and MasterWeightAdamW's fp32 masters) on the device
    host_optimizer: int
    host_weights: int  # cpu_offload: the parameters on the host
    gradients_sharded: int  # every trained parameter's gradient once the step's backward is done
    host_gradients: int  # cpu_offload: those gradients on the host
    lora_elements: int  # every adapter copy, on this rank
    trainable_elements: int  # the trained adapter (every base parameter with full fine-tuning), on this rank
    trainable_tensors: int
    reference_device: int = 0  # full fine-tuning's frozen reference copy on the device
    host_reference: int = 0  # ... on the host (cpu_offload)


def stored_tensor_bytes(ctx: Context, layout: Layout, element_bytes: int | None = None) -> list[int]:
    """Each base tensor's bytes on rank 0 as stored, in the layout's order: rank 0's shard under
    FSDP (the whole tensor when it is replicated or unsharded), at ``element_bytes`` per element
    (default ``Context.stored_bytes``), QLoRA's packed NF4 weights at one byte per stored element."""
    w = ctx.stored_bytes if element_bytes is None else element_bytes
    return [
        (t.local(ctx.shard_group) if ctx.fsdp is not None else t.numel) * (1 if t.four_bit else w)
        for t in layout.base_tensors
    ]


def base_weight_bytes(ctx: Context, layout: Layout, element_bytes: int | None = None) -> tuple[int, int]:
    """(weights, weights_replicated) on rank 0 before any offload, at ``element_bytes`` per
    element (default: the actor's stored dtype, ``Context.stored_bytes``).

    Unsharded every rank holds the whole base; under FSDP rank 0 holds ceil(d0 / S) rows of
    each sharded tensor, and the replicated ones whole. QLoRA stores each linear the spec
    marks 4-bit packed in NF4 (one byte per two values, sharded like any tensor) and keeps its
    quantisation state whole on every rank (:func:`nf4_state_bytes`); the
    embeddings, lm_head, norms and biases stay in the weights dtype.
    """
    w = ctx.stored_bytes if element_bytes is None else element_bytes
    key = ("base", w, ctx.fsdp is None, ctx.shard_group)
    if key in layout.sums:
        return layout.sums[key]
    constants = sum(nf4_state_bytes(2 * t.numel) for t in layout.base_tensors if t.four_bit)
    stored = stored_tensor_bytes(ctx, layout, w)
    if ctx.fsdp is None:
        result = sum(stored) + constants, 0
    else:
        result = (
            sum(n for n, t in zip(stored, layout.base_tensors) if t.sharded) + constants,
            sum(n for n, t in zip(stored, layout.base_tensors) if not t.sharded),
        )
    layout.sums[key] = result
    return result


def trained_elements(ctx: Context, layout: Layout) -> tuple[int, int, int]:
    """(elements of every adapter copy, of the trained parameters, trained tensors) on rank 0.
    With full fine-tuning the trained parameters are the base tensors (local shards and the
    replicated ones)."""
    key = ("trained", ctx.shard_group, ctx.full_finetune)
    if key not in layout.sums:
        if ctx.full_finetune:
            base = sum(t.local(ctx.shard_group) if ctx.sharded else t.numel for t in layout.base_tensors)
            layout.sums[key] = (0, base, len(layout.base_tensors))
        else:
            lora = sum(t.local(ctx.shard_group) for t in layout.lora_tensors)
            adapters = ctx.num_adapters
            layout.sums[key] = (lora, lora // adapters if adapters else lora, len(layout.lora_tensors) // adapters)
    return layout.sums[key]


def static_memory(ctx: Context, layout: Layout) -> StaticMemory:
    """Weights, adapters, optimizer state, sharded gradients and the reference copy of rank 0.

    Optimizer state on the device: 8 bytes per trainable element and 4 per trainable tensor
    (MasterWeightAdamW beside low-precision weights: 12, its fp32 master too).
    optim_cpu_offload (CPUOffloadAdamW) keeps 16 per element on the host (master, gradient,
    moments) and 4 per tensor; cpu_offload moves the sharded parameters and their gradients
    to the host, where fused AdamW keeps its 8 per element beside them, leaving only the
    replicated tensors on the device.
    """
    weights, weights_replicated = base_weight_bytes(ctx, layout)
    lora_elements, trainable, trainable_tensors = trained_elements(ctx, layout)
    lora_bytes = lora_elements * 4  # PEFT keeps adapters in fp32
    offload_optim = bool(ctx.fsdp and ctx.fsdp.optim_cpu_offload)
    cpu_offload = bool(ctx.fsdp and ctx.fsdp.cpu_offload)
    # unsharded full fine-tuning of low-precision weights: fp32 masters beside the moments
    master = 4 if ctx.full_finetune and not ctx.sharded and ctx.stored_bytes != 4 else 0
    reference = 0
    if ctx.reference_copy:
        reference = sum(base_weight_bytes(ctx, layout, ctx.weight_bytes))
    host_reference = 0
    if cpu_offload:
        host_weights = weights + lora_bytes
        replicated_lora = sum(t.numel * 4 for t in layout.lora_tensors if not t.sharded)
        weights, lora_device = 0, replicated_lora
        if reference:
            ref_sharded, ref_replicated = base_weight_bytes(ctx, layout, ctx.weight_bytes)
            host_reference, reference = ref_sharded, ref_replicated
    else:
        host_weights, lora_device = 0, lora_bytes
    if offload_optim:
        optimizer_device, host_optimizer = 0, trainable * 16 + trainable_tensors * 4
    elif cpu_offload:
        optimizer_device, host_optimizer = 0, trainable * 8 + trainable_tensors * 4
    else:
        optimizer_device, host_optimizer = trainable * (8 + master) + trainable_tensors * 4, 0
    return StaticMemory(
        weights=weights,
        weights_replicated=weights_replicated,
        lora_device=lora_device,
        optimizer_device=optimizer_device,
        host_optimizer=host_optimizer,
        host_weights=host_weights,
        gradients_sharded=0 if cpu_offload else trainable * 4,
        host_gradients=trainable * 4 if cpu_offload else 0,
        lora_elements=lora_elements,
        trainable_elements=trainable,
        trainable_tensors=trainable_tensors,
        reference_device=reference,
        host_reference=host_reference,
    )


def static_components(memory: StaticMemory) -> dict[str, int]:
    """The components every phase holds."""
    return {
        "weights": memory.weights,
        "weights_replicated": memory.weights_replicated,
        "lora": memory.lora_device,
        "reference_weights": memory.reference_device,
        "optimizer_state": memory.optimizer_device,
    }


@dataclass(frozen=True, slots=True)
class GradientTerms:
    prior: int  # gradients of the earlier micro-batches of this step, as the last one starts
    final: int = 0  # every trained gradient once the last micro-batch's backward is done
    # How the held gradients change once a unit has reduce-scattered in the last micro-batch: a new
    # sharded gradient (one micro-batch), an accumulated unsharded one replaced by its shard
    # (deferred sync: negative), or nothing (the shards of earlier micro-batches, added to in place).
    # ... a trained untied lm_head's, or a tied one's: its gradient (V x H x p), which autograd
    # sums from the chunked head and the model's own head into the embedding table's input buffer
    # and holds through every block's backward, until the embeddings add theirs (``tied_head``)
    head: int = 0
    per_unit: tuple[int, ...] = ()  # ... each block unit's, in order (empty: none changes)
    # Per block unit, its post-backward at the reduce-scatter: (the change of the gradients held, the
    # unit's own freed once copied in and the output shard made; the reduce-scatter's input, and
    # gloo's copy of it on CPU)
    unit_reducing: tuple[tuple[int, int], ...] = ()
    # ... and as it starts: (its compute-dtype gradient, all made; the reduce-scatter input of the
    # unit before it in backward order, which FSDP2 frees only after accumulating and resharding)
    unit_entering: tuple[tuple[int, int], ...] = ()
    embed: int = 0  # the trained embeddings' gradient as it is made, at the very end of the backward
    embed_buffer: int = 0  # ... its reduce-scatter input (and gloo's copy, on CPU), the output shard beside
    # ... how the held gradients change at that reduce-scatter: the gradient is freed once copied in
    # (deferred sync: the accumulated fp32 one, counted in ``prior``; else made at the backward's end)
    embed_reducing: int = 0
    # a trained untied lm_head unit's unsharded gradient at its reduce-scatter (none where the trainer's
    # head gathers a copy of its own: trainer_gathers_head)
    head_reducing: int = 0
    head_buffer: int = 0  # ... its reduce-scatter input (and gloo's copy of it, on CPU)
    head_output: int = 0  # ... and output: this rank's shard of the gradient, in reduce_dtype
    tied_head: int = 0  # of ``head``, a tied head's gradient (the root reduce-scatters it, last)


def _full_unit_elements(ctx: Context, layout: Layout, unit) -> int:
    """A unit's trained elements, unsharded: its sharded adapters (LoRA) or base tensors (full)."""
    if ctx.full_finetune:
        return sum(t.numel for t in unit.base if t.sharded)
    return sum(t.numel for t in unit.lora if t.sharded) // ctx.num_adapters


def _held_elements(ctx: Context, unit, *, sharded_only: bool = False) -> int:
    """A unit's trained elements on this rank, as the held gradient stores them (sharded or whole);
    ``sharded_only``: those FSDP2 shards (replicated ones, under the persistence threshold, keep
    whole gradients of their own, never reduce-scattered)."""
    tensors = unit.base if ctx.full_finetune else unit.lora
    if sharded_only:
        count = sum(t.local(ctx.shard_group) for t in tensors if t.sharded)
    else:
        count = sum(t.local(ctx.shard_group) if ctx.sharded else t.numel for t in tensors)
    return count if ctx.full_finetune else count // ctx.num_adapters


def gradient_terms(ctx: Context, layout: Layout, memory: StaticMemory) -> GradientTerms:
    """Gradients through the learn phase's last micro-batch.

    With more than one micro-batch the earlier ones' gradients are held: unsharded with
    defer_grad_sync, in reduce_dtype (FSDP2's post-backward upcasts a gradient it does not
    reduce into ``unsharded_accumulated_grad``: read from its source, and measured by the
    probe since it registers them), else sharded in fp32 (unsharded: fp32 local, the fp32
    masters' with full fine-tuning). With one micro-batch nothing is held at its start and
    the gradients appear as the backward goes: a trained lm_head's first (``head``), then
    each block unit's (``per_unit``), the embeddings' last (``embed``, made in the compute
    dtype before it is reduced or added to its master).

    Under FSDP each unit's post-backward starts with its compute-dtype gradient all made
    (``unit_entering``), adds it into the accumulated one (deferred sync: freeing it) or keeps it,
    copies the gradient into a reduce-scatter input in reduce_dtype, frees it (foreach_reduce
    clears its list once copied in) and reduce-scatters into a new shard (``unit_reducing``); the
    shard stays (``per_unit``; traced on 2 gloo ranks: at a full fine-tune's block reduce-scatter
    under deferred sync, counted with the block's accumulated gradient still held, learn read
    9-22% high). A trained untied lm_head's is a moment of its own (``head_*``).
    """
    p = ctx.compute_bytes
    one = ctx.micro_batches == 1
    key = ("gradient_units", ctx.full_finetune, ctx.shard_group, ctx.sharded)
    if key not in layout.sums:
        layout.sums[key] = (
            tuple(_full_unit_elements(ctx, layout, u) for u in layout.block_units),
            tuple(_held_elements(ctx, u) for u in layout.block_units),
            tuple(_held_elements(ctx, u, sharded_only=True) for u in layout.block_units),
            _held_elements(ctx, next((u for u in layout.units if u.name == "lm_head"), layout.root))
            if ctx.full_finetune and layout.head is not None
            else 0,
        )
    full_units, held_units, shard_units, held_head = layout.sums[key]
    embed = 0
    if ctx.full_finetune:
        embed = layout.embed.numel * p
        if ctx.fsdp is None and ctx.stored_bytes == 4:
            embed = 0  # fp32 weights: autograd accumulates into their own gradient
    fsdp = ctx.fsdp
    tied = tied_head_gradient_bytes(ctx, layout)
    if fsdp is None:
        return GradientTerms(
            prior=0 if one else memory.trainable_elements * 4,
            final=memory.trainable_elements * 4,
            embed=embed,
            head=(held_head * 4 if one else 0) + tied,
            per_unit=tuple(n * 4 for n in held_units) if one else (),
            tied_head=tied,
        )
    reduce_bytes = DTYPE_BYTES[fsdp.reduce_dtype]
    accumulates = not one and fsdp.defer_grad_sync
    head = layout.head
    trained_head = head.numel if ctx.full_finetune and head is not None and head.sharded else 0
    # FSDP2's unit reduces the head's gradient, or the trainer's own copy of it does (at once, into
    # the sharded parameter's gradient: nothing unsharded accumulates over the micro-batches)
    head_full = 0 if trainer_gathers_head(ctx, layout) else trained_head
    # a new shard's bytes on the device: none under cpu_offload, where FSDP2 copies it to the host
    kept = 0 if fsdp.cpu_offload else 4
    trainers = _head_sharded_gradient(ctx, layout)
    if one:
        changes = tuple((n - s) * 4 + s * kept for n, s in zip(held_units, shard_units))
        prior, head_change = 0, held_head * kept
    elif accumulates:
        if "trained_full" not in layout.sums:  # every trained element, unsharded (the layout knows which)
            layout.sums["trained_full"] = (
                sum(t.numel for t in layout.base_tensors)
                if ctx.full_finetune
                else sum(t.numel for t in layout.lora_tensors) // ctx.num_adapters
            )
        prior = (layout.sums["trained_full"] - trained_head + head_full) * reduce_bytes + trainers
        changes = tuple(shard * kept - full * reduce_bytes for full, shard in zip(full_units, shard_units))
        # FSDP2's head unit frees its accumulated gradient for a new shard; the trainer's own copy's
        # shard is in prior already, and changes nothing here
        head_change = -head_full * reduce_bytes + (0 if trainers else held_head * kept)
    else:
        prior, changes, head_change = memory.gradients_sharded, (), 0
    copies = reduce_scatter_copies(ctx)
    return GradientTerms(
        prior=prior,
        final=memory.gradients_sharded,
        head=head_change + tied,
        tied_head=tied,
        per_unit=changes,
        unit_reducing=tuple(
            (shard * reduce_bytes - (full * reduce_bytes if accumulates else 0), full * reduce_bytes * copies)
            for full, shard in zip(full_units, shard_units)
        ),
        unit_entering=tuple((full * p, before) for full, before in zip(full_units, _reduce_inputs_before(ctx, layout))),
        embed=embed,
        head_reducing=0 if accumulates else head_full * p,
        head_buffer=head_full * reduce_bytes * copies,
        head_output=head.local(ctx.shard_group) * reduce_bytes if head_full and head is not None else 0,
        embed_buffer=(
            layout.embed.numel * reduce_bytes * copies + layout.embed.local(ctx.shard_group) * reduce_bytes
            if ctx.full_finetune and layout.embed.sharded
            else 0
        ),
        embed_reducing=-layout.embed.numel * reduce_bytes if accumulates and ctx.full_finetune else 0,
    )


def tied_head_gradient_bytes(ctx: Context, layout: Layout) -> int:
    """A tied head's gradient through the blocks' backward (full fine-tuning): the
    embedding table is one leaf used three times (the chunked head, the model's own one-position
    head, the embeddings), so autograd sums the two heads' gradients (V x H x p) in the leaf's
    input buffer and holds the sum until the embeddings' backward adds the third, at the very end
    (traced on 2 gloo ranks: counted without it, a block's backward read 3.0% low). 0 otherwise."""
    if not ctx.full_finetune or not ctx.spec.tie_word_embeddings or layout.head is not None:
        return 0
    return layout.embed.numel * ctx.compute_bytes


def trainer_gathers_head(ctx: Context, layout: Layout) -> bool:
    """Whether the trainer's chunked head gathers a copy of its own of an untied lm_head unit's
    weight (agilerl's LLMAlgorithm._model_head_without_grad): under FSDP with reshard_after_forward,
    whose forward leaves the unit resharded. The model's own one-position head then runs without
    grad, so FSDP2's unit gathers the head in no backward and reduce-scatters none of its
    gradient; the copy's backward reduce-scatters it (:func:`_head_sharded_gradient`). Under
    reshard_after_forward=False the chunked head reads the weight the forward left unsharded, and
    the unit reduce-scatters its gradient in its post-backward."""
    head = layout.head
    return ctx.fsdp is not None and ctx.fsdp.reshard_after_forward and head is not None and head.sharded


def _head_sharded_gradient(ctx: Context, layout: Layout) -> int:
    """A trained untied lm_head's gradient this rank holds sharded from the first micro-batch on,
    deferred sync or not, where the trainer's chunked head gathers its own copy of the weight
    (:func:`trainer_gathers_head`): materialize_dtensors' backward reduce-scatters the head's
    gradient into the sharded fp32 parameter's own (planner.memory._logits.head_weight_bytes).
    Traced on 2 gloo ranks: V x H x 4 / S already held as the second micro-batch's head ran
    backward."""
    head, fsdp = layout.head, ctx.fsdp
    if not ctx.full_finetune or not trainer_gathers_head(ctx, layout) or head is None or fsdp is None:
        return 0
    return 0 if fsdp.cpu_offload else head.local(ctx.shard_group) * 4  # (offloaded: the host's)


def reduce_inputs_held(ctx: Context, layout: Layout) -> tuple[int, ...]:
    """Per layer, the reduce-scatter input FSDP2 holds while that layer runs backward: the one of
    the unit after its own in forward order (which reduce-scattered last), or none (the last
    unit's, or that unit trains nothing). FSDP2 keeps each reduce-scatter's input until the next
    unit's post-backward (``reduce_scatter_states``, one buffer by default, so a later stream
    cannot reuse it while the collective may still read it), on GPUs as on CPU. Traced on 2 gloo
    ranks: a full fine-tune's last block ran backward beside its untied head's, the blocks before
    beside the next block's (counted without them, a peak there read 4.8-6.2% low). Empty
    unsharded."""
    inputs = _unit_reduce_inputs(ctx, layout) + (0,)
    return tuple(inputs[k + 1] for k in layout.layer_units) if ctx.fsdp is not None else ()


def _reduce_inputs_before(ctx: Context, layout: Layout) -> tuple[int, ...]:
    """Per block unit, the reduce-scatter input held as its post-backward starts: the next unit's
    in forward order (:func:`reduce_inputs_held`; the block units are consecutive in
    ``layout.units``)."""
    inputs = _unit_reduce_inputs(ctx, layout) + (0,)
    first = layout.layer_units[0]
    return inputs[first + 1 : first + 1 + len(layout.block_units)]


def reduce_input_held_at_end(ctx: Context, layout: Layout) -> int:
    """The reduce-scatter of the first block unit as the backward ends (the embeddings' gradient
    being made; 0 unsharded): its input (:func:`reduce_inputs_held`), which FSDP2 keeps until the
    backward's end, on a GPU while the collective may still run beside it. Not gloo's copy: that
    lives inside the call only. Counted with it, a tied full fine-tune in one micro-batch on 2
    gloo ranks read 5.5% high (17.90 MiB against 16.96) once the probe settled gloo's late frees
    (planner.probe.gloo); before, about half the runs had caught the copy still alive."""
    if ctx.fsdp is None:
        return 0
    return _unit_reduce_inputs(ctx, layout)[layout.layer_units[0]]


def _unit_reduce_inputs(ctx: Context, layout: Layout) -> tuple[int, ...]:
    """Per unit, its trained gradient's reduce-scatter input in reduce_dtype (0 unsharded); made
    once per layout and what it depends on (``layout.sums``): a learn phase asks three times."""
    if ctx.fsdp is None:
        return (0,) * len(layout.units)
    reduce_bytes = DTYPE_BYTES[ctx.fsdp.reduce_dtype]
    gathers = trainer_gathers_head(ctx, layout)  # then the head's unit reduce-scatters nothing
    key = ("reduce_inputs", ctx.full_finetune, ctx.num_adapters, reduce_bytes, gathers)
    if key not in layout.sums:
        layout.sums[key] = tuple(
            0 if gathers and u.name == "lm_head" else _full_unit_elements(ctx, layout, u) * reduce_bytes
            for u in layout.units
        )
    return layout.sums[key]


def reduce_scatter_copies(ctx: Context) -> int:
    """Copies of a reduce-scatter's input alive while it runs: the input, and on CPU a second,
    as gloo's reduce-scatter reduces a copy of it (traced on 2 gloo ranks: the input's bytes
    again inside the call); NCCL reduces in place."""
    return 1 if ctx.on_gpu else 2


def step_optimizer_bytes(ctx: Context, memory: StaticMemory) -> int:
    """Optimizer state during clip and AdamW: on the device, plus the step's update per
    tensor (4 bytes) when it runs there. On a CPU run the "host" state is in the same memory:
    all of it (CPUOffloadAdamW's fp32 masters and their gradients beside the moments, or
    cpu_offload's moments), not the moments alone."""
    step = memory.optimizer_device + (0 if memory.host_optimizer else memory.trainable_tensors * 4)
    if not ctx.on_gpu:
        step += memory.host_optimizer
    return step


def largest_base_elements(layout: Layout) -> int:
    if "largest_base" not in layout.sums:
        layout.sums["largest_base"] = max((t.numel for t in layout.base_tensors), default=0)
    return layout.sums["largest_base"]


def load_gathered_bytes(ctx: Context, layout: Layout) -> int:
    """Loading under FSDP materialises one tensor at a time: the largest, in the stored dtype
    (fp32 for full fine-tuning's shards)."""
    return largest_base_elements(layout) * ctx.stored_bytes if ctx.sharded else 0


def load_host_checkpoint_bytes(ctx: Context, layout: Layout) -> int:
    """Host memory of the checkpoint being loaded: a tensor at a time under FSDP, else the whole model."""
    if ctx.sharded:
        return load_gathered_bytes(ctx, layout)
    return ctx.spec.total_params * ctx.weight_bytes


def save_gathered_bytes(ctx: Context, layout: Layout) -> int:
    """Saving gathers the trained tensors one at a time: the largest adapter (fp32), or with
    full fine-tuning the largest base tensor in its stored dtype."""
    if ctx.full_finetune:
        return largest_base_elements(layout) * ctx.stored_bytes
    if "largest_lora" not in layout.sums:
        layout.sums["largest_lora"] = max((t.numel for t in layout.lora_tensors), default=0)
    return layout.sums["largest_lora"] * 4


def save_host_checkpoint_bytes(ctx: Context, memory: StaticMemory) -> int:
    """Rank 0 keeps every rank's trained weights and AdamW moments (fp32) on the host: the
    adapters, or with full fine-tuning the whole model in its stored dtype (and the fp32
    masters of a low-precision model)."""
    shards = ctx.shard_group if ctx.sharded else 1
    if ctx.full_finetune:
        master = 4 if not ctx.sharded and ctx.stored_bytes != 4 else 0
        return memory.trainable_elements * shards * (ctx.stored_bytes + 8 + master)
    return memory.lora_elements * 4 * shards + memory.trainable_elements * 8 * shards
