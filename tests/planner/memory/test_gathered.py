"""planner.memory._gathered: the window of gathered units, on a hand-made gathering order."""

from __future__ import annotations

import math

from agilerl.distributed import FSDPConfig
from planner.memory._gathered import (
    Gathered,
    PostBackwardWindows,
    after_forward_bytes,
    backward_gathered_bytes,
    backward_layer_windows,
    between_steps_bytes,
    build_gathered,
    forward_unit_windows,
    in_flight,
    model_head_backward_bytes,
    nograd_gathered_bytes,
    post_backward_windows,
    reversed_with_parents,
)
from planner.memory._units import build_layout

from .conftest import make_context

# embed 10, block 0 (own 20, experts 5), block 1 (own 20, experts 5), head 30; root 1, buffer 7.
ORDER = ((10, None, 10), (20, None, 20), (5, 1, 5), (20, None, 20), (5, 3, 5), (30, None, 30))
GATHERED = Gathered(
    unit_bytes=(10, 25, 25, 30),
    root_bytes=1,
    root_ahead=1,
    all_bytes=91,
    order=ORDER,
    largest_bytes=30,
    buffer_bytes=7,
)


def test_backward_order_puts_each_block_ahead_of_its_experts():
    assert reversed_with_parents(ORDER) == [
        (30, None, 30),
        (20, None, 20),
        (5, 1, 5),
        (20, None, 20),
        (5, 3, 5),
        (10, None, 10),
    ]


def test_forward_window_holds_the_running_unit_twice_and_the_next_outer_unit(dense_spec):
    ctx = make_context(dense_spec, fsdp=FSDPConfig())
    # Block 1 runs with its own parameters twice and the head prefetched (20 + 20 + 30), but the
    # head's copy-out is larger: the head twice and block 1's all-gather output, not yet dropped
    # (30 + 30 + 20), beside the root.
    assert in_flight(ctx, GATHERED, 1, forward=True) == 80 + 1
    # Two prefetched: block 0's experts (5) in block 0 (20), its own copy-out (5), block 1 and the head.
    assert (
        in_flight(ctx, GATHERED, 2, forward=True)
        == max(10 + 10 + 20 + 20, 20 + 20 + 20 + 30, 5 + 20 + 5 + 20 + 30, 20 + 20 + 30) + 1
    )
    assert nograd_gathered_bytes(ctx, GATHERED) == 81


def _two_blocks(root: int, *, ranks: int) -> Gathered:
    """Two 20-byte block units after a root (tied embeddings: no embedding or head unit)."""
    ahead = 20 if ranks > 1 else 0  # on one rank FSDP2 all-gathers nothing
    order = ((20, None, ahead), (20, None, ahead))
    root_ahead = root if ranks > 1 else 0
    return Gathered((20, 20), root, root_ahead, 40 + root, order, largest_bytes=20, buffer_bytes=0)


def test_the_first_units_copy_out_holds_the_roots_all_gather_output(dense_spec):
    # Tied embeddings: the root (50) is the embedding table and the first unit a block. FSDP2 keeps
    # the root's all-gather output until block 0's copy-out returns: the root twice, block 0 twice.
    ctx = make_context(dense_spec, fsdp=FSDPConfig())
    assert in_flight(ctx, _two_blocks(50, ranks=2), 1, forward=True) == 20 + 20 + 50 + 50
    # Later forwards find the root gathered: block 0 twice and block 1 in flight, beside the root.
    assert in_flight(ctx, _two_blocks(50, ranks=2), 1, forward=True, first=False) == 20 + 20 + 20 + 50
    # On one rank there is no all-gather output to hold (and a prefetch holds nothing).
    assert in_flight(ctx, _two_blocks(50, ranks=1), 1, forward=True) == 20 + 50


def test_a_later_generate_steps_first_copy_out_holds_the_step_befores_last_all_gather_output(dense_spec):
    # embed 40, block 20, untied head 30; root 1. Generate is one root forward to FSDP2, so the
    # head's all-gather output from the step before is dropped only at the next step's first
    # copy-out: the embeddings twice beside it (40 + 40 + 30), more than the embeddings running
    # with the block prefetched (40 + 40 + 20) or the head's copy-out (30 + 30 + 20).
    ctx = make_context(dense_spec, fsdp=FSDPConfig())
    order = ((40, None, 40), (20, None, 20), (30, None, 30))
    gathered = Gathered((40, 20, 30), 1, 1, 91, order, largest_bytes=40, buffer_bytes=0)
    assert in_flight(ctx, gathered, 1, forward=True, first=False) == 40 + 40 + 30 + 1
    # the first step: the root's all-gather output (1) is held there instead
    assert in_flight(ctx, gathered, 1, forward=True) == 40 + 40 + 20 + 1


def test_backward_window_adds_the_buffer(dense_spec):
    ctx = make_context(dense_spec, fsdp=FSDPConfig())
    # The head with block 1 prefetched: 30 + 20, the root and the buffer.
    assert in_flight(ctx, GATHERED, 1, forward=False) == 50 + 1 + 7


def test_without_resharding_everything_stays_gathered(dense_spec):
    ctx = make_context(dense_spec, fsdp=FSDPConfig(reshard_after_forward=False))
    assert in_flight(ctx, GATHERED, 1, forward=False) == 91 + 7
    assert nograd_gathered_bytes(ctx, GATHERED) == after_forward_bytes(ctx, GATHERED) == 91
    assert after_forward_bytes(make_context(dense_spec, fsdp=FSDPConfig()), GATHERED) == 1  # the root
    unsharded = make_context(dense_spec, fsdp=None)
    assert in_flight(unsharded, GATHERED, 1, forward=True) == nograd_gathered_bytes(unsharded, GATHERED) == 0
    # generate's steps after its first keep the last unit's (the head's) all-gather output beside
    # everything: no later step gathers, so no copy-out drops it until generate returns
    assert nograd_gathered_bytes(ctx, GATHERED, first=False) == 91 + 30
    assert between_steps_bytes(ctx, GATHERED) == 91 + 30
    assert between_steps_bytes(make_context(dense_spec, fsdp=FSDPConfig()), GATHERED) == 1 + 30


def test_a_forward_regathering_without_resharding_keeps_each_unit_it_has_run(dense_spec):
    # generate's prefill under reshard_after_forward=False: the step before's backward resharded
    # every unit; each one that has run stays gathered beside the running one (held twice) and
    # the next, in flight (every block sharded: none under the persistence threshold)
    ctx = make_context(dense_spec, fsdp=FSDPConfig(reshard_after_forward=False, param_persistence_threshold=0))
    layout = build_layout(ctx)
    gathered = build_gathered(ctx, layout)
    names = [u.name for u in layout.units]
    assert names[0] == "embed" and names[-1] == "lm_head"  # untied, one block a unit
    sizes, root = gathered.unit_bytes, gathered.root_bytes
    windows = forward_unit_windows(ctx, layout, gathered, regathers=True)
    for k, (running, copying) in enumerate(windows):
        coming = sizes[k + 1] if k + 1 < len(sizes) else 0
        assert running == root + sum(sizes[:k]) + 2 * sizes[k] + coming, names[k]
        # at its copy-out the unit before's all-gather output is still held (the root's before
        # the first unit), and the next unit is not yet prefetched; then the unit prefetches
        # the next, beside the bf16 copy of that one's local fp32 adapter shards (2 ranks)
        before = sizes[k - 1] if k else gathered.root_ahead
        nxt = layout.units[k + 1].lora if k + 1 < len(sizes) else ()
        cast = sum(math.ceil(t.rows / 2) * t.rest * 2 for t in nxt if t.sharded)
        held = root + sum(sizes[:k]) + 2 * sizes[k]
        assert copying == held + max(before, coming + cast), names[k]
    # the head's copy-out is the widest: every unit, the head twice and the last block's output
    assert max(windows, key=lambda w: w[1]) == windows[-1]
    assert windows[-1][1] > windows[-1][0]
    # a forward after the step's no-grad passes finds every unit gathered
    assert {w for pair in forward_unit_windows(ctx, layout, gathered) for w in pair} == {gathered.all_bytes}


def test_the_backward_reshards_each_unit_once_through_without_resharding_after_forward(dense_spec):
    # under reshard_after_forward=False the forward left every unit gathered; FSDP2 reshards each
    # in its post-backward, so layer j runs backward beside the root and the units up to its own
    fsdp = FSDPConfig(reshard_after_forward=False, param_persistence_threshold=0)
    ctx = make_context(dense_spec, fsdp=fsdp)
    layout = build_layout(ctx)
    gathered = build_gathered(ctx, layout)
    sizes = gathered.unit_bytes  # embed, 4 blocks, lm_head
    windows = backward_layer_windows(ctx, layout, gathered)
    assert windows == tuple(
        gathered.root_bytes + sum(sizes[: j + 2]) + gathered.buffer_bytes for j in range(dense_spec.num_layers)
    )
    assert windows[-1] == gathered.all_bytes - sizes[-1] + gathered.buffer_bytes  # the head already resharded
    # resharding after forward: the backward gathers one unit at a time, the same window at every layer
    ctx = make_context(dense_spec, fsdp=fsdp.model_copy(update={"reshard_after_forward": True}))
    assert set(backward_layer_windows(ctx, layout, gathered)) == {backward_gathered_bytes(ctx, gathered)}
    assert backward_layer_windows(make_context(dense_spec), layout, gathered) == ()  # unsharded


def test_a_unit_reshards_before_its_reduce_scatter_without_resharding_after_forward(dense_spec):
    # FSDP2's post-backward reshards a unit, then reduce-scatters its gradients; the units after it
    # in forward order have done so already, the ones before it are still gathered from the forward
    fsdp = FSDPConfig(reshard_after_forward=False, param_persistence_threshold=0)
    ctx = make_context(dense_spec, fsdp=fsdp)
    layout = build_layout(ctx)
    gathered = build_gathered(ctx, layout)
    embed, *blocks, head = gathered.unit_bytes
    assert len(blocks) == dense_spec.num_layers
    root, buffer = gathered.root_bytes, gathered.buffer_bytes
    windows = post_backward_windows(ctx, layout, gathered)
    assert windows.head == root + embed + sum(blocks)  # the head's own copy gone
    assert windows.block == root + embed + sum(blocks[:-1]) + buffer  # the last block's, the widest
    assert windows.end == root + embed + blocks[0] + buffer  # no hook reshards the first block
    full = make_context(dense_spec, fsdp=fsdp, full_finetune=True)
    full_layout = build_layout(full)
    full_gathered = build_gathered(full, full_layout)
    # trained embeddings: the first block's input has a gradient, and its hook reshards it
    assert post_backward_windows(full, full_layout, full_gathered).end == (
        full_gathered.root_bytes + full_gathered.unit_bytes[0] + full_gathered.buffer_bytes
    )
    # each block unit reduce-scatters beside the units before it only (the last block's the widest)
    assert windows.block_reducing == tuple(
        root + embed + sum(blocks[:k]) + buffer for k in range(dense_spec.num_layers)
    )
    assert windows.block_reducing[-1] == windows.block
    # resharding after forward: the trainer's head reduces its own gradient, so the head's unit has no
    # reduce-scatter; a block unit starts its post-backward under the backward's window and
    # reduce-scatters with its own copy resharded, beside the unit its pre-backward prefetched (the
    # one before it in forward order: the embeddings for the first block)
    ctx = make_context(dense_spec, fsdp=fsdp.model_copy(update={"reshard_after_forward": True}))
    windows = post_backward_windows(ctx, layout, gathered)
    assert windows.head == 0
    assert windows.block == backward_gathered_bytes(ctx, gathered)
    assert windows.block_reducing == tuple(root + buffer + before for before in (embed, *blocks[:-1]))
    # the backward's end: every block resharded, the embeddings' unit the first block prefetched
    assert windows.end == root + buffer + embed
    assert post_backward_windows(make_context(dense_spec), layout, gathered) == PostBackwardWindows(0, 0, (), 0)


def test_a_prefetch_holds_the_cast_copy_of_the_units_local_shards(dense_spec):
    # embed 10, two blocks 20, head 30 (root 1); each all-gather first casts the unit's local
    # fp32 shards to the compute dtype: 5, 10, 10, 15 bytes (a full fine-tune on 2 ranks)
    order = ((10, None, 10), (20, None, 20), (20, None, 20), (30, None, 30))
    gathered = Gathered((10, 20, 20, 30), 1, 1, 81, order, largest_bytes=30, buffer_bytes=0, cast=(5, 10, 10, 15))
    ctx = make_context(dense_spec, fsdp=FSDPConfig())
    # Block 1 (twice) prefetches the head: its output and its 15-byte cast, before block 1 runs.
    assert in_flight(ctx, gathered, 1, forward=True, moment="copying") == 20 + 20 + 30 + 15 + 1
    assert in_flight(ctx, gathered, 1, forward=True, moment="running") == 20 + 20 + 30 + 1
    # Without the casts the head's copy-out is the widest copying moment (head twice, block 1's output).
    plain = Gathered((10, 20, 20, 30), 1, 1, 81, order, largest_bytes=30, buffer_bytes=0)
    assert in_flight(ctx, plain, 1, forward=True, moment="copying") == 30 + 30 + 20 + 1
    # Two prefetched: block 0 issues the head only (block 1 is in flight from the embeddings),
    # the embeddings issue both blocks; block 1 issues nothing.
    assert in_flight(ctx, gathered, 2, forward=True, moment="copying") == 20 + 20 + 20 + 30 + 15 + 1
    # The backward casts too, but its gradients outsize the cast: not counted there.
    assert in_flight(ctx, gathered, 1, forward=False) == in_flight(ctx, plain, 1, forward=False)


def test_the_cast_shards_are_a_full_fine_tunes_fp32_shards_not_its_reference_copys(dense_spec):
    fsdp = FSDPConfig(param_persistence_threshold=0)
    ctx = make_context(dense_spec, fsdp=fsdp, full_finetune=True)
    layout = build_layout(ctx)
    gathered = build_gathered(ctx, layout)
    for u, cast in zip(layout.units, gathered.cast):  # dense: one gathering entry per unit
        assert cast == sum(math.ceil(t.rows / 2) * t.rest * 2 for t in u.base), u.name
        assert 0 < cast < gathered.unit_bytes[layout.units.index(u)]
    assert build_gathered(ctx, layout, casts=False).cast == ()
    # A bf16 base computing in bf16 casts only the fp32 adapters; an fp32 compute dtype nothing.
    lora = make_context(dense_spec, fsdp=fsdp)
    lora_layout = build_layout(lora)
    assert build_gathered(lora, lora_layout).cast == tuple(
        sum(math.ceil(t.rows / 2) * t.rest * 2 for t in u.lora) for u in lora_layout.units
    )
    fp32 = make_context(dense_spec, fsdp=FSDPConfig(param_dtype="float32"), weights_dtype="float32")
    assert build_gathered(fp32, build_layout(fp32)).cast == ()
    # On one rank FSDP2 all-gathers nothing, so it casts nothing either.
    one = make_context(dense_spec, fsdp=fsdp, full_finetune=True, gpus=1)
    assert not any(build_gathered(one, build_layout(one)).cast)


def test_the_model_heads_backward_runs_beside_the_last_unit_the_root_prefetched(dense_spec):
    # its logits' hook fires the root's pre-backward, which all-gathers the unit that ran forward
    # last (here the head, 30) beside the root (1); kept gathered, everything is already there
    assert model_head_backward_bytes(make_context(dense_spec, fsdp=FSDPConfig()), GATHERED) == 1 + 30
    kept = make_context(dense_spec, fsdp=FSDPConfig(reshard_after_forward=False))
    assert model_head_backward_bytes(kept, GATHERED) == 91
    assert model_head_backward_bytes(make_context(dense_spec, fsdp=None), GATHERED) == 0
