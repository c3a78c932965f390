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
        return self.host_peak_bytes * self.gpus_per_node
