"""Rollout engines on ranks of their own: the trainer ranks send them weights and prompts.

A manifest's ``training.rollout_engines_per_agent: E`` (the seed's "vLLM engines per member,
one GPU each") gives each population member E engine ranks beside its trainer ranks. The
trainer sees a :class:`RemoteEngine`, which implements the engine protocol
(:class:`agilerl.utils.engine.RolloutEngine`) over two process groups of the member:

- the *rollout group*, every trainer rank and every engine rank: the trainer's first rank
  broadcasts each command; for ``generate`` every trainer rank contributes its prompts
  (all-gathered), each engine generates a contiguous share, and the completions come back the
  same way, each trainer rank keeping its own;
- the *sync group*, the trainer's first rank and the engine ranks: ``load_weights`` streams the
  merged weights (base plus scaled LoRA, Hugging Face names, gathered one module at a time on
  the trainer ranks) tensor by tensor from that rank to every engine, which loads them as they
  arrive.

An engine rank runs :func:`serve_rollout_engine` until the trainer says ``stop``. Its engine is
:class:`HFGenerateEngine`, Hugging Face generate on the engine rank's own copy of the model; any
object with the engine protocol serves. A vLLM engine there is not supported yet: in process
beside torchrun's group it would build its own groups over every rank. Engines on their own
ranks never sleep: nothing else needs their memory.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from agilerl.utils.generation import neutral_generation_config

__all__ = ["EngineRanks", "RemoteEngine", "HFGenerateEngine", "serve_rollout_engine", "engine_ranks"]


@dataclass(frozen=True)
class EngineRanks:
    """One population member's ranks around its engines, and the two groups (module doc)."""

    trainers: tuple[int, ...]
    engines: tuple[int, ...]
    rollout_group: dist.ProcessGroup
    sync_group: dist.ProcessGroup

    @property
    def leader(self) -> int:
        """The trainer rank that commands the engines (the member's first)."""
        return self.trainers[0]


#: How long an engine rank waits for its trainers' next command: a whole learn step, a checkpoint
#: save or a model load in between (the trainers' own collectives keep init_distributed's timeout).
ENGINE_WAIT = datetime.timedelta(hours=6)


def engine_ranks(trainers: Sequence[int], engines: Sequence[int]) -> EngineRanks:
    """The member's rollout and sync groups, made by every rank of the member, trainer or engine,
    in the same order, before any group of the trainers alone (ranks of other members need not
    take part).

    torch names a group made by its own ranks from those ranks and from how many groups the
    process has made, so every rank of a group must have made as many before it: a trainer that
    is not in the sync group makes a group of itself instead, and the trainers' own group comes
    after these (agilerl.train), where every trainer has made two. Made in another order, the
    ranks wait for each other in ``new_group`` for ever.
    """
    from agilerl.distributed import group_of_ranks

    trainers, engines = tuple(sorted(trainers)), tuple(sorted(engines))
    rollout = group_of_ranks([*trainers, *engines], timeout=ENGINE_WAIT)
    sync_ranks = [trainers[0], *engines]
    if dist.get_rank() in sync_ranks:
        sync = group_of_ranks(sync_ranks, timeout=ENGINE_WAIT)
    else:  # not cached: it stands in for the sync group in the count, once
        sync = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return EngineRanks(trainers=trainers, engines=engines, rollout_group=rollout, sync_group=sync)


def _broadcast_command(ranks: EngineRanks, command: dict | None) -> dict:
    box = [command]
    dist.broadcast_object_list(box, src=ranks.leader, group=ranks.rollout_group)
    return box[0]


def _share(total: int, parts: int, index: int) -> slice:
    """The contiguous share ``index`` of ``total`` items split into ``parts`` (the first ones one larger)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return slice(start, start + base + (1 if index < extra else 0))


class RemoteEngine:
    """The trainer ranks' side of engines on ranks of their own (module doc). Every trainer rank
    of the member calls each method together, as it does a colocated engine's."""

    def __init__(self, ranks: EngineRanks) -> None:
        self.ranks = ranks
        self.me = dist.get_rank()

    def sleep(self, level: int) -> None:  # the engine's GPU is its own: nothing to free
        return None

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream ``weights`` (consumed on every trainer rank: producing them gathers) from the
        member's first trainer rank to every engine rank."""
        leader = self.me == self.ranks.leader
        _broadcast_command(self.ranks, {"op": "load_weights"} if leader else None)
        for name, tensor in weights:
            if not leader:
                continue
            tensor = tensor.detach().contiguous().cpu()
            dist.broadcast_object_list(
                [(name, tuple(tensor.shape), tensor.dtype)], src=self.me, group=self.ranks.sync_group
            )
            dist.broadcast(tensor, src=self.me, group=self.ranks.sync_group)
        if leader:
            dist.broadcast_object_list([None], src=self.me, group=self.ranks.sync_group)

    def generate(self, prompts, *, max_tokens, temperature, seed=None, stop_token_ids=(), min_tokens=0):
        leader = self.me == self.ranks.leader
        params = dict(
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            stop_token_ids=list(stop_token_ids),
            min_tokens=min_tokens,
        )
        _broadcast_command(self.ranks, {"op": "generate", **params} if leader else None)
        mine = [list(map(int, p)) for p in prompts]
        everyone: list = [None] * dist.get_world_size(self.ranks.rollout_group)
        dist.all_gather_object(everyone, ("prompts", mine), group=self.ranks.rollout_group)
        answers: list = [None] * len(everyone)
        dist.all_gather_object(answers, ("completions", []), group=self.ranks.rollout_group)
        completions = [c for kind, part in answers if kind == "completions" for c in part]
        # the trainer ranks' prompts in rank order; this rank's are its share of them
        counts = [len(part) for kind, part in everyone if kind == "prompts"]
        index = self.ranks.trainers.index(self.me)
        start = sum(counts[:index])
        return completions[start : start + counts[index]]

    def stop(self) -> None:
        """End the engine ranks' service (every trainer rank calls it)."""
        _broadcast_command(self.ranks, {"op": "stop"} if self.me == self.ranks.leader else None)


def _received(ranks: EngineRanks) -> Iterator[tuple[str, torch.Tensor]]:
    while True:
        meta = [None]
        dist.broadcast_object_list(meta, src=ranks.leader, group=ranks.sync_group)
        if meta[0] is None:
            return
        name, shape, dtype = meta[0]
        tensor = torch.empty(shape, dtype=dtype)
        dist.broadcast(tensor, src=ranks.leader, group=ranks.sync_group)
        yield name, tensor


def serve_rollout_engine(engine, ranks: EngineRanks) -> int:
    """An engine rank's loop: load the weights and generate as the member's trainer ranks ask,
    until ``stop``. Returns the number of generate calls served."""
    served = 0
    engine_index = ranks.engines.index(dist.get_rank())
    while True:
        command = _broadcast_command(ranks, None)
        match command["op"]:
            case "stop":
                return served
            case "load_weights":
                engine.load_weights(_received(ranks))
            case "generate":
                everyone: list = [None] * dist.get_world_size(ranks.rollout_group)
                dist.all_gather_object(everyone, ("engine", []), group=ranks.rollout_group)
                prompts = [p for kind, part in everyone if kind == "prompts" for p in part]
                share = _share(len(prompts), len(ranks.engines), engine_index)
                seed = command["seed"]
                out = engine.generate(
                    prompts[share],
                    max_tokens=command["max_tokens"],
                    temperature=command["temperature"],
                    seed=None if seed is None else seed + share.start,
                    stop_token_ids=command["stop_token_ids"],
                    min_tokens=command["min_tokens"],
                )
                dist.all_gather_object([None] * len(everyone), ("completions", out), group=ranks.rollout_group)
                served += 1
            case other:
                raise RuntimeError(f"unknown engine command {other!r}")


class HFGenerateEngine:
    """The engine protocol on Hugging Face generate: the engine rank's own copy of the model in
    ``dtype`` and the trainers' attention (``attn_implementation``; None: transformers' default),
    its weights replaced by every ``load_weights``. Sampling seeds the whole batch with ``seed``
    (one draw per batch, not per prompt)."""

    def __init__(
        self,
        model_source: str,
        *,
        dtype: str = "bfloat16",
        device: str = "cpu",
        pad_token_id: int = 0,
        attn_implementation: str | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        from agilerl.algorithms.core.loading import has_weights

        kwargs = {"dtype": getattr(torch, dtype)}
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        if has_weights(model_source):
            self.model = AutoModelForCausalLM.from_pretrained(model_source, **kwargs)
        else:
            from transformers import AutoConfig

            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_source), **kwargs)
        self.model.to(device).eval()
        self.device, self.pad_token_id = device, pad_token_id
        self._names = dict(self.model.named_parameters())

    def sleep(self, level: int) -> None:
        return None

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        return None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        state = self.model.state_dict()
        for name, tensor in weights:
            if name not in state:
                from agilerl.utils.engine import EngineError

                raise EngineError(
                    f"the engine's model has no weight {name!r}: the trainer's model and the engine's differ"
                )
            state[name].copy_(tensor.to(state[name].dtype))

    @torch.no_grad()
    def generate(self, prompts, *, max_tokens, temperature, seed=None, stop_token_ids=(), min_tokens=0):
        if not prompts:
            return []
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        if seed is not None:
            torch.manual_seed(seed)
        with neutral_generation_config(self.model):  # the checkpoint's sampling settings do not apply
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=max_tokens,
                min_new_tokens=min_tokens or None,
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_k=0,
                top_p=1.0,
                pad_token_id=self.pad_token_id,
                eos_token_id=list(stop_token_ids) or None,
            )
        completions = []
        stops = set(stop_token_ids)
        for row in out[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            completions.append(row[:cut])
        return completions
