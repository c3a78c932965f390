"""Per-phase peak memory of a real run, by the shared component names (imports torch).

One tracker per phase (a tracker's global peak cannot be reset):

- on CPU, torch's ``FSDPMemTracker`` (sharded) or ``MemTracker`` (unsharded)
  counts live tensor bytes by category; the categories map onto the
  estimate's component names (planner.probe.COMPONENTS);
- on CUDA, ``max_memory_allocated`` / ``max_memory_reserved`` are reset per
  phase and give the totals (the tracker still gives the breakdown);
- the host's peak resident set (VmHWM, reset per phase through
  ``/proc/self/clear_refs``) catches ranks that hold full CPU copies.

Parameter bytes are exact (counted from the model, split into base weights,
replicated weights and LoRA); the rest comes from the tracker:

    Unsharded Param, All Gather -> weights_gathered (FSDP2's all-gather output
                                   is the gathered weights in flight)
    Sharded/Unsharded Grad      -> gradients
    OptState                    -> optimizer_state
    Activation, Inputs, Other   -> activations
    Temp                        -> logits (tensors made outside module forwards:
                                   the chunked log-prob head and the loss)
    Reduce Scatter              -> comm_buffers
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["PhaseRecorder", "LiveBytes", "param_bytes", "host_peak_reset", "host_peak_bytes"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def param_bytes(model: nn.Module) -> dict[str, int]:
    """This rank's parameter bytes: base weights (sharded or full), replicated plain ones, LoRA."""
    out = {"weights": 0, "weights_replicated": 0, "lora": 0}
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    for name, p in model.named_parameters():
        nbytes = _local(p).numel() * p.element_size()
        if ".lora_" in name:
            out["lora"] += nbytes
        elif sharded and not isinstance(p, DTensor):
            out["weights_replicated"] += nbytes
        else:
            out["weights"] += nbytes
    for buf in model.buffers():
        out["weights"] += buf.numel() * buf.element_size()
    out["weights"] += quant_state_bytes(model)
    return out


def quant_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """QLoRA's NF4 quantisation states on this rank: each 4-bit linear keeps its whole bitsandbytes
    ``QuantState`` (absmax, the NF4 code, the offset and the nested state that quantises the
    absmax) as plain tensors, neither parameters nor buffers, so neither a parameter count nor a
    tracker's module walk sees them. One tensor per storage."""
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        for state in (getattr(module, "quant_state", None), getattr(weight, "quant_state", None)):
            while state is not None:
                for t in (getattr(state, "absmax", None), getattr(state, "code", None), getattr(state, "offset", None)):
                    if isinstance(t, torch.Tensor):
                        found.setdefault(t.untyped_storage().data_ptr(), t)
                state = getattr(state, "state2", None)
    return list(found.values())


def quant_state_bytes(model: nn.Module) -> int:
    """Bytes of :func:`quant_state_tensors` (counted in a probe's weights)."""
    return sum(t.untyped_storage().nbytes() for t in quant_state_tensors(model))


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages made while active that are still alive, and their peak.

    A TorchDispatchMode sees every op's outputs; each new storage is followed with a
    finalizer, so a tensor counts until its storage is freed, however it was made (views
    share their base's). ``exclude``: storage pointers not to count (parameters, inputs).
    The tape of planner.memory is checked against it (benchmarks/activation_census.py).
    """

    def __init__(self, exclude: set[int] | None = None) -> None:
        super().__init__()
        self.exclude: set[int] = set(exclude or ())
        self.live: dict[int, int] = {}
        self.total, self.peak = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live and key not in self.exclude:
                    self.live[key] = storage.nbytes()
                    self.total += storage.nbytes()
                    self.peak = max(self.peak, self.total)
                    weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.total -= self.live.pop(key, 0)


def host_peak_reset() -> None:
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def host_peak_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_CATEGORY = {
    "Unsharded Param": "weights_gathered",
    "All Gather": "weights_gathered",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "Gradient": "gradients",
    "OptState": "optimizer_state",
    "Optstate": "optimizer_state",
    "Activation": "activations",
    "Inputs": "activations",
    "Other": "activations",
    "Temp": "logits",
    "Reduce Scatter": "comm_buffers",
}
_PARAM_CATEGORIES = {"Sharded Param", "Parameter", "Buffer"}


def _repeating_mem_tracker():
    from torch.distributed._tools.mem_tracker import MemTracker

    class RepeatingMemTracker(MemTracker):
        """MemTracker that accepts a module called again at top level (generate, micro-batches).

        Per-module statistics are reset; the global peak, which is all we
        read, is kept.
        """

        def _pre_fw_hook(self, module, inputs):
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:
                self.reset_mod_stats()
                super()._pre_fw_hook(module, inputs)

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            # Gradient hooks cannot be registered on frozen parameters (the LoRA
            # base); mark them as already hooked with handles that do nothing.
            for p in module.parameters():
                if not p.requires_grad and p not in self._param_to_grad_hook_handles:
                    self._param_to_grad_hook_handles[p] = (_NOOP_HANDLE, _NOOP_HANDLE)
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return RepeatingMemTracker()


def _repeating_fsdp_mem_tracker(model, optimizer):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class RepeatingFSDPMemTracker(FSDPMemTracker):
        """FSDPMemTracker that accepts units called again at top level (micro-batches, generation).

        The tracker refuses a second top-level call of a unit before touching any
        state; dropping that unit's per-module statistics and retrying keeps the
        global peak, which is all we read.
        """

        def _fsdp_state_pre_forward(self, fsdp_mod, orig_fsdp_state_pre_fw):
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig_fsdp_state_pre_fw)

            def retrying(*args, **kwargs):
                try:
                    return inner(*args, **kwargs)
                except NotImplementedError:
                    self.memory_tracking.pop(fsdp_mod, None)
                    return inner(*args, **kwargs)

            return retrying

        # Blocks grouped into one unit (wrap_every_n_blocks > 1) share a param group;
        # the tracker would wrap its backward hooks once per block and restore them in
        # the wrong order. Wrap each param group once; restore the true originals.
        @staticmethod
        def _wrap_once(wrap, fsdp_mod, orig):
            if getattr(orig, "_agilerl_tracked", False):
                return orig
            inner = wrap(fsdp_mod, orig)
            inner._agilerl_tracked = True
            return inner

        def _fsdp_param_group_pre_backward(self, fsdp_mod, orig):
            return self._wrap_once(super()._fsdp_param_group_pre_backward, fsdp_mod, orig)

        def _fsdp_param_group_post_backward(self, fsdp_mod, orig):
            return self._wrap_once(self._post_backward_wrapper, fsdp_mod, orig)

        def _post_backward_wrapper(self, fsdp_mod, orig):
            """FSDPMemTracker's post-backward wrapper, but holding no gradient while the post-backward
            runs. Torch's keeps the last parameter's unsharded gradient in a local variable through
            it, past FSDP2's accumulation and reduce-scatter copy-in, which free it: a unit of one
            large parameter (an untied head or embeddings, fully fine-tuned) read its whole
            gradient high there (measured: 1 MiB of a 2-rank run's learn peak, in the heap too)."""
            from torch.distributed._tools.fsdp2_mem_tracker import _FSDPModState, _FSDPRefType, _FSDPState

            def register(kind, grads) -> None:
                for grad in grads:
                    self._update_and_maybe_create_winfos(grad, kind, update_existing=True)

            def inner(*args, **kwargs):
                group = fsdp_mod._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    register(_FSDPRefType.UNSHARDED_GRAD, _accumulated_gradients(group))
                snapshots = self.memory_tracking[fsdp_mod].snapshots
                snapshots.setdefault(_FSDPModState.BEF_POST_BW, []).append(self.get_tracker_snapshot())
                self._fsdp_state = _FSDPState.POST_BW
                orig(*args, **kwargs)
                if group is not None:
                    register(_FSDPRefType.SHARDED_GRAD, _sharded_grads(group))
                snapshots.setdefault(_FSDPModState.AFT_POST_BW, []).append(self.get_tracker_snapshot())

            return inner

        def __enter__(self):
            self._agilerl_groups = {
                id(group): (group, {k: group.__dict__.get(k) for k in ("pre_backward", "post_backward")})
                for group in fsdp_param_groups(self._root_mod)
            }
            entered = super().__enter__()
            # Gradients accumulated by earlier micro-batches (defer_grad_sync) predate this
            # tracker; register them, or its post-backward bookkeeping cannot find them.
            from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

            for group, _ in self._agilerl_groups.values():
                for grad in _accumulated_gradients(group):
                    self._update_and_maybe_create_winfos(grad, _FSDPRefType.UNSHARDED_GRAD)
                # Units an earlier forward left gathered (reshard_after_forward=False): the tracker
                # registers unsharded parameters in a unit's pre-forward, so one that does not run
                # in this phase (the actor while a full fine-tune's reference copy runs) would go
                # unseen, and the resident scan skips them as the model's own parameters.
                for param in _gathered_parameters(group):
                    self._update_and_maybe_create_winfos(param, _FSDPRefType.UNSHARDED_PARAM)
            return entered

        def __exit__(self, *args):
            super().__exit__(*args)
            for group, saved in self._agilerl_groups.values():
                for name, value in saved.items():
                    if value is None:
                        group.__dict__.pop(name, None)
                    else:
                        group.__dict__[name] = value

    return RepeatingFSDPMemTracker(model, optimizer)


def _accumulated_gradients(group) -> list[torch.Tensor]:
    """Unsharded gradients an FSDP2 param group holds: the unsharded parameter's ``.grad`` (made by
    this backward, or kept between micro-batches under defer_grad_sync) and, when reduce_dtype
    differs from the gradient's dtype, the upcast copy FSDP2 accumulates the earlier micro-batches'
    into (``unsharded_accumulated_grad``)."""
    out = []
    for fsdp_param in group.fsdp_params:
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        for grad in (
            getattr(unsharded, "grad", None) if unsharded is not None else None,
            getattr(fsdp_param, "unsharded_accumulated_grad", None),
        ):
            if grad is not None:
                out.append(grad)
    return out


def _sharded_grads(group) -> list[torch.Tensor]:
    """The gradients an FSDP2 param group's sharded parameters hold (after a reduce-scatter)."""
    return [p.sharded_param.grad for p in group.fsdp_params if p.sharded_param.grad is not None]


def _gathered_parameters(group) -> list[torch.Tensor]:
    """The unsharded parameters of an FSDP2 param group that is gathered now."""
    if not group.is_unsharded:
        return []
    return [fsdp_param.unsharded_param for fsdp_param in group.fsdp_params]


def resident_tensors(device: torch.device, *, known: set[int]) -> list[torch.Tensor]:
    """Plain tensors on ``device`` alive now whose storage is not in ``known`` (the tracker's
    own: parameters, buffers, gradients, optimizer state), found through the garbage
    collector, which tracks every tensor object. DTensor wrappers are skipped: their local
    tensors are listed."""
    import gc

    out, seen = [], set(known)
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or isinstance(obj, DTensor) or obj.device.type != device.type:
                continue
            key = obj.untyped_storage().data_ptr()
        except (ReferenceError, RuntimeError):  # a dead proxy, a tensor without storage
            continue
        if key and key not in seen:
            seen.add(key)
            out.append(obj)
    return out


def fsdp_param_groups(model: nn.Module) -> list:
    """The FSDP2 param groups of ``model``'s units, each once (a grouped unit's blocks share one)."""
    from torch.distributed.fsdp import FSDPModule

    groups: dict[int, object] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                groups.setdefault(id(group), group)
    return list(groups.values())


def accumulated_fsdp_gradients(model: nn.Module) -> list[torch.Tensor]:
    """:func:`_accumulated_gradients` of every FSDP2 unit of ``model``: tensors made before a
    phase's tracker starts, which it would not see."""
    return [g for group in fsdp_param_groups(model) for g in _accumulated_gradients(group)]


class _NoopHandle:
    def remove(self) -> None:
        pass


_NOOP_HANDLE = _NoopHandle()


@dataclass
class PhaseRecorder:
    """A ``phase_observer`` for the trainer: records each phase's peak (max over its occurrences)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    device: torch.device
    enabled: bool = True
    peaks: dict[str, dict[str, int]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    static: dict[str, int] = field(default_factory=dict)
    #: full fine-tuning's frozen reference copy: its parameters are counted as reference_weights, and
    #: what its units gather while it runs is found among the tensors a phase makes
    reference: nn.Module | None = None
    #: False (CUDA only): no tensor tracker, each record is the allocator's peaks and the parameters
    components: bool = True

    def __post_init__(self) -> None:
        if not self.components and self.device.type != "cuda":
            raise ValueError("a phase record without components needs CUDA's allocator peaks")
        # Exact parameter bytes while sharded. Later, FSDP may hold units unsharded
        # (reshard_after_forward=False keeps them gathered after a no-grad forward).
        self.static = param_bytes(self.model)
        # Counted in static["weights"]; no tracker sees them (kept out of the resident scan below).
        self.quant_state = quant_state_bytes(self.model)
        if self.reference is not None:
            self.static["reference_weights"] = sum(param_bytes(self.reference).values())
        self.sharded = any(isinstance(p, DTensor) for p in self.model.parameters())
        # FSDPMemTracker replaces FSDP2's group hooks of multi-block units with per-module
        # ones and does not restore them; grouped layouts get the generic tracker, which
        # observes through global module hooks (no FSDP categories, same totals).
        from agilerl.distributed import fsdp_layout

        layout = fsdp_layout(self.model)
        self.fsdp_categories = self.sharded and (layout is None or layout.config.wrap_every_n_blocks == 1)
        self.replicated_lora = (
            sum(
                _local(p).numel() * p.element_size()
                for n, p in self.model.named_parameters()
                if ".lora_" in n and not isinstance(p, DTensor)
            )
            if self.sharded
            else 0
        )

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        host_peak_reset()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        if not self.components:
            try:
                yield
            finally:
                self._keep(name, self._allocator_record())
            return
        accumulated = 0
        if self.fsdp_categories:
            tracker = _repeating_fsdp_mem_tracker(self.model, self.optimizer)
        else:
            tracker = _repeating_mem_tracker()
            tracker.track_external(*(m for m in (self.model, self.optimizer) if m is not None))
            if self.sharded:
                # Gradients earlier micro-batches left unsharded predate this tracker: counted as
                # "Other" (activations), moved to gradients below.
                grads = accumulated_fsdp_gradients(self.model)
                tracker.track_external(*grads)
                accumulated = sum(g.numel() * g.element_size() for g in grads)
                del grads  # holding them would keep each alive past its reduce-scatter
        # Everything else an earlier phase left alive (units FSDP kept unsharded after a no-grad
        # forward, the reference log-probs) is memory this phase holds too: a tracker sees only
        # what is made while it runs, so register what is resident now.
        tracker.track_external(*resident_tensors(self.device, known=self._known_storages()))
        # A device-resident master optimizer's tensors as the phase starts: tracked as resident tensors
        # (counted as activations), re-attributed to optimizer_state in the record.
        masters = self._device_masters()
        self._master_bytes = sum(_local(t).numel() * t.element_size() for t in masters)
        inner = getattr(self.optimizer, "inner", None)
        self._inner_state_bytes = (
            sum(
                v.numel() * v.element_size()
                for state in inner.state.values()
                for v in state.values()
                if isinstance(v, torch.Tensor) and v.device.type == self.device.type
            )
            if masters and inner is not None
            else 0
        )
        try:
            with tracker:
                yield
        finally:
            snapshot = tracker.get_tracker_snapshot("peak")
            record = self._components(snapshot, seen_reference=self._seen_reference_shards(tracker))
            moved = min(accumulated, record["activations"])
            record["activations"] -= moved
            record["gradients"] += moved
            record["host_peak"] = host_peak_bytes()
            if cuda:
                torch.cuda.synchronize(self.device)
                record["cuda_max_allocated"] = torch.cuda.max_memory_allocated(self.device)
                record["cuda_max_reserved"] = torch.cuda.max_memory_reserved(self.device)
            self._keep(name, record)

    def _keep(self, name: str, record: dict[str, int]) -> None:
        previous = self.peaks.get(name)
        if previous is None or record["total"] > previous["total"]:
            self.peaks[name] = record

    def _allocator_record(self) -> dict[str, int]:
        """The phase's record from CUDA's allocator alone: its peaks (the total is the allocated
        one, tensors only, as a tracker's) and the parameters' bytes."""
        torch.cuda.synchronize(self.device)
        allocated = torch.cuda.max_memory_allocated(self.device)
        return {
            **self.static,
            "total": allocated,
            "cuda_max_allocated": allocated,
            "cuda_max_reserved": torch.cuda.max_memory_reserved(self.device),
            "host_peak": host_peak_bytes(),
        }

    def _known_storages(self) -> set[int]:
        """Storages the trackers count on their own: parameters, buffers, their gradients and
        the optimizer's state (local shards of DTensors)."""
        tensors = [*self.model.parameters(), *self.model.buffers(), *quant_state_tensors(self.model)]
        tensors += [p.grad for p in self.model.parameters() if p.grad is not None]
        if self.optimizer is not None:
            tensors += [
                v for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
            ]
            # an offloading optimizer's host state is reported apart (host_optimizer_state); the fp32
            # masters of one on the device are resident tensors like any other (moved to optimizer_state
            # in the record)
            tensors += getattr(self.optimizer, "host_tensors", list)()
        if self.reference is not None:
            tensors += [*self.reference.parameters(), *self.reference.buffers()]
        return {_local(t).untyped_storage().data_ptr() for t in tensors}

    def _device_masters(self) -> list[torch.Tensor]:
        """A MasterWeightAdamW's fp32 masters, their gradients and moments kept on this device
        (full fine-tuning of a low-precision model unsharded; CPUOffloadAdamW's are the host's)."""
        masters = getattr(self.optimizer, "master_tensors", None)
        if masters is None or hasattr(self.optimizer, "host_tensors"):
            return []
        return [t for t in masters() if t.device.type == self.device.type]

    def _seen_reference_shards(self, tracker) -> int:
        """Bytes of what reference_weights counts that the tracker registered too: the generic
        tracker registers the parameters and buffers of every module that runs, and a sharded
        reference copy's root pre-forward finds them sharded."""
        if self.reference is None or not self.sharded or self.fsdp_categories:
            return 0
        tracked = {storage.data_ptr() for storage in list(getattr(tracker, "_WINFO", {}).keys())}
        return sum(nbytes for ptr, nbytes in self._reference_storages().items() if ptr in tracked)

    def _reference_storages(self) -> dict[int, int]:
        """Storage pointer -> bytes of the reference copy's resident tensors on this device: its
        units' local shards (whether or not a unit is gathered now), its replicated parameters
        and its buffers; not the unsharded copies of units gathered now."""
        assert self.reference is not None
        found: dict[int, int] = {}
        gathered: set[int] = set()
        tensors: list[torch.Tensor] = []
        for group in fsdp_param_groups(self.reference):
            tensors += [_local(fsdp_param.sharded_param) for fsdp_param in group.fsdp_params]
            gathered.update(p.untyped_storage().data_ptr() for p in _gathered_parameters(group))
        tensors += [_local(t) for t in (*self.reference.parameters(), *self.reference.buffers())]
        for t in tensors:
            storage = t.untyped_storage()
            if t.device.type == self.device.type and storage.data_ptr() not in gathered:
                found.setdefault(storage.data_ptr(), storage.nbytes())
        return found

    def _components(self, snapshot: dict, *, seen_reference: int = 0) -> dict[str, int]:
        device_snap: dict = {}
        for dev, values in snapshot.items():
            if torch.device(dev).type == self.device.type:
                device_snap = {getattr(k, "value", k): int(v) for k, v in values.items()}
        record = dict.fromkeys(
            [
                "weights",
                "weights_gathered",
                "weights_replicated",
                "lora",
                "reference_weights",
                "gradients",
                "optimizer_state",
                "activations",
                "logits",
                "comm_buffers",
            ],
            0,
        )
        record.update(self.static)
        tracked_params = 0
        for category, nbytes in device_snap.items():
            if category == "Total":
                continue
            if category in _PARAM_CATEGORIES:
                tracked_params += nbytes
                continue
            record[_CATEGORY.get(category, "activations")] += nbytes
        if self.sharded:
            # The trackers count the module parameters they find: the local shards, or whole
            # units FSDP left unsharded; FSDPMemTracker does not see replicated (ignored) ones.
            local = self.static["weights"] - self.quant_state + self.static["lora"] + self.static["weights_replicated"]
            replicated = self.static["weights_replicated"] + self.replicated_lora
            unseen = replicated if self.fsdp_categories else 0
            record["weights_gathered"] += max(0, tracked_params - seen_reference - (local - unseen))
            unseen += self.quant_state - seen_reference  # the quantisation states; the reference's shards twice
        else:
            # The generic tracker counts the parameters of every module that runs, the reference copy's too.
            own = sum(v for k, v in self.static.items() if k != "reference_weights")
            unseen = max(0, own - tracked_params)  # the quantisation states among them
            seen_reference = min(record["reference_weights"], max(0, tracked_params - own))
            unseen -= seen_reference
        record["tracker_total"] = device_snap.get("Total", 0)
        record["tracker_params"] = tracked_params
        # A device-resident master optimizer's tensors were tracked as resident ("activations"), except its
        # inner AdamW's moments where the step hooks saw them as optimizer state: move the rest there.
        seen_state = device_snap.get("OptState", 0) + device_snap.get("Optstate", 0)
        masters = getattr(self, "_master_bytes", 0) - min(seen_state, getattr(self, "_inner_state_bytes", 0))
        moved = min(record["activations"], max(0, masters))
        record["activations"] -= moved
        record["optimizer_state"] += moved
        # the reference copy's local shards: known to no tracker
        record["total"] = record["tracker_total"] + unseen + record["reference_weights"]
        return record


def device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters())
    return _local(p).device
