"""What estimate() returns: per-rank bytes per phase and component, against capacity."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class PhaseEstimate(BaseModel):
    model_config = ConfigDict(frozen=True)

    components: dict[str, int]
    host: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.components.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


class Estimate(BaseModel):
    """Per-rank memory of one GRPO run, per phase and component, against capacity."""

    model_config = ConfigDict(frozen=True)

    phases: dict[str, PhaseEstimate]
    capacity_bytes: int
    gpus_per_node: int
    notes: tuple[str, ...] = ()

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k].total)

    @property
    def peak_bytes(self) -> int:
        return self.phases[self.peak_phase].total

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.peak_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0

    @property
    def host_peak_bytes(self) -> int:
        return max(p.host_total for p in self.phases.values())

    @property
    def host_per_node_bytes(self) -> int:
        """Host memory of a node's ranks at the phase where their sum peaks: the first node's,
        which holds rank 0 (:meth:`node_host_bytes` of ``gpus_per_node`` ranks)."""
        return self.node_host_bytes(self.gpus_per_node)

    def node_host_bytes(self, ranks: int, *, rank0: bool = True) -> int:
        """Host memory of ``ranks`` trainer ranks on one node at the phase where their sum peaks.
        Rank 0 alone keeps the checkpoint a save gathers (``host_checkpoint`` of ``save``): the
        node holds it only with ``rank0``; every other host term is each rank's own."""
        return self._node_host(ranks, rank0)[1]

    def node_host_phase(self, ranks: int, *, rank0: bool = True) -> str:
        """The phase where :meth:`node_host_bytes` peaks ("save" where rank 0's gathered
        checkpoint is the largest host term)."""
        return self._node_host(ranks, rank0)[0]

    def _node_host(self, ranks: int, rank0: bool) -> tuple[str, int]:
        def node(name: str, phase: PhaseEstimate) -> int:
            rank0_only = phase.host.get("host_checkpoint", 0) if name == "save" else 0
            return phase.host_total * ranks - rank0_only * (ranks - 1 if rank0 else ranks)

        sums = {name: node(name, phase) for name, phase in self.phases.items()} if ranks else {}
        return max(sums.items(), key=lambda kv: kv[1], default=(next(iter(self.phases), ""), 0))
