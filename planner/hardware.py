"""GPUs and clusters. Pure data.

``memory_bytes`` is what ``torch.cuda.get_device_properties().total_memory``
reports (less than the marketing figure: the driver reserves some). The CUDA
context is allocated outside the PyTorch caching allocator; its default here is
a public measurement where one exists (A100 ~501 MiB, L4 ~226 MiB) and 512 MiB
otherwise, and probes on the GPU calibrate it (planner.calibration).
"""

from __future__ import annotations

import difflib
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "GPU",
    "Cluster",
    "GPUS",
    "gpu_by_name",
    "CPU_DEVICE",
    "MAX_GPUS",
    "MARGIN_FRACTION",
    "GIB",
    "MIB",
    "fmt_bytes",
    "memory_unit",
    "memory_words",
    "gpu_for_device",
    "with_memory",
    "memory_bytes",
    "MAX_MEMORY_GIB",
]

#: Share of each GPU's memory a plan keeps free (the default of plan(), the CLI's --margin and the tuner).
MARGIN_FRACTION = 0.05

GIB = 2**30
MIB = 2**20


def fmt_bytes(n: float | None) -> str:
    """``1.23 GiB`` from a GiB up, else ``45.60 MiB``; ``-`` for None."""
    if n is None:
        return "-"
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.2f} MiB"


def memory_unit(capacity: float) -> tuple[str, int]:
    """The unit a figure is said in beside a memory of ``capacity`` bytes: GiB for GPUs and
    hosts; MiB under 4 GiB (the small budgets of CPU probes and tests)."""
    return ("MiB", MIB) if capacity < 4 * GIB else ("GiB", GIB)


def memory_words(n: float, capacity: float) -> str:
    """``n`` bytes in :func:`memory_unit` of ``capacity``: ``75.24 GiB``, or ``42.50 MiB``."""
    unit, scale = memory_unit(capacity)
    return f"{n / scale:.2f} {unit}"


#: The most trainer GPUs a plan takes (2**17, above the largest training clusters built): more is a typo.
MAX_GPUS = 2**17


class GPU(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Annotated[str, Field(description="Device name.")]
    memory_bytes: Annotated[int, Field(gt=0, description="Device memory as torch reports it.")]
    kind: Annotated[Literal["cuda", "rocm", "cpu"], Field(description="Accelerator family ('cpu' for CPU probes).")] = (
        "cuda"
    )
    cuda_context_bytes: Annotated[int, Field(ge=0, description="Context memory outside the caching allocator.")] = (
        512 * MIB
    )
    cublas_workspace_bytes: Annotated[
        int,
        Field(
            ge=0,
            description="PyTorch's default cuBLAS workspace per handle and stream, from its caching allocator "
            "(CUBLAS_WORKSPACE_CONFIG unset): 32 MiB on compute capability 9.0 (Hopper), else 8 MiB + 128 KiB.",
        ),
    ] = 8 * MIB + 128 * 1024
    memory_bandwidth_gbps: Annotated[float | None, Field(description="HBM bandwidth, GB/s.")] = None
    source: Annotated[str, Field(description="Where the figures come from.")] = ""


GPUS: dict[str, GPU] = {
    g.name: g
    for g in [
        GPU(
            name="A100-40GB",
            memory_bytes=42_505_273_344,
            cuda_context_bytes=501 * MIB,
            memory_bandwidth_gbps=1555,
            source="NVIDIA A100 datasheet; context: public measurement (~501 MiB)",
        ),
        GPU(
            name="A100-80GB",
            memory_bytes=85_100_068_864,
            cuda_context_bytes=501 * MIB,
            memory_bandwidth_gbps=2039,
            source="NVIDIA A100 datasheet; context as A100-40GB",
        ),
        GPU(
            name="H100-80GB",
            memory_bytes=85_045_231_616,
            cuda_context_bytes=685 * MIB,
            cublas_workspace_bytes=32 * MIB,
            memory_bandwidth_gbps=3350,
            source="NVIDIA H100 SXM datasheet; context as the measured H200's: the same GH100 die and "
            "132 SMs, so the same per-SM local memory and sm_90 kernel images",
        ),
        GPU(
            name="H200",
            memory_bytes=143_155 * MIB,
            cuda_context_bytes=685 * MIB,
            cublas_workspace_bytes=32 * MIB,
            memory_bandwidth_gbps=4800,
            source="NVIDIA H200 datasheet (141 GB HBM3e); memory as torch reports it (139.80 GiB; NVML says "
            "143,771 MiB) and context measured on one H200 SXM, torch 2.11 + CUDA 13.0 "
            "(benchmarks/results/gpu_nvidia-h200.txt)",
        ),
        GPU(
            name="L4",
            memory_bytes=23_580_639_232,
            cuda_context_bytes=226 * MIB,
            memory_bandwidth_gbps=300,
            source="NVIDIA L4 datasheet; context: public measurement (~226 MiB)",
        ),
        GPU(name="A10G", memory_bytes=23_836_098_560, memory_bandwidth_gbps=600, source="AWS G5 / NVIDIA A10G"),
        GPU(name="RTX-4090", memory_bytes=25_390_809_088, memory_bandwidth_gbps=1008, source="NVIDIA RTX 4090 specs"),
        GPU(
            name="MI300X",
            memory_bytes=205_822_885_888,
            kind="rocm",
            memory_bandwidth_gbps=5300,
            source="AMD Instinct MI300X datasheet (192 GB HBM3)",
        ),
    ]
}

#: A CPU "device" for probes and tests: no GPU-only terms.
CPU_DEVICE = GPU(name="cpu", memory_bytes=64 * GIB, kind="cpu", cuda_context_bytes=0, source="CPU probe")


def gpu_by_name(name: str) -> GPU:
    """A catalog GPU by name, case- and punctuation-insensitive, or by a shorter name that only it
    answers to (:func:`_answers_to`: ``h100``, ``4090``, ``a100-80``, ``mi300``); KeyError naming
    the GPUs a short name fits where it fits several (``a100``: its 40 GB and 80 GB kinds differ in
    what fits), else with suggestions."""
    table = {_norm(k): v for k, v in GPUS.items()}
    key = _norm(name)
    if key in table:
        return table[key]
    matches = [gpu for gpu in GPUS.values() if _answers_to(gpu.name, key)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise KeyError(f"GPU {name!r} could be {' or '.join(g.name for g in matches)}: give one of them")
    close = difflib.get_close_matches(name, list(GPUS), n=3, cutoff=0.3)
    raise KeyError(
        f"unknown GPU {name!r}; known: {', '.join(GPUS)}" + (f" (did you mean {', '.join(close)}?)" if close else "")
    )


def _norm(s: str) -> str:
    return "".join(ch for ch in s.lower() if ch.isalnum())


def _answers_to(name: str, key: str) -> bool:
    """Whether a catalog GPU ``name`` answers to the short name ``key`` (normalised): one with a
    number in it that is a whole part of the name (``h100`` of H100-80GB, ``4090`` of RTX-4090) or
    its start, cut where a run of digits or letters ends (``a10080``, ``mi300``). Not ``h20`` for
    H200 (another GPU), nor ``rtx`` or ``l`` (no model number)."""
    if not any(ch.isdigit() for ch in key):
        return False
    full = _norm(name)
    if key in (_norm(part) for part in name.split("-")):
        return True
    if not full.startswith(key) or len(key) == len(full):
        return False
    return key[-1].isdigit() != full[len(key)].isdigit()


def with_memory(gpu: GPU, gib: float, what: str = "GPU memory") -> GPU:
    """``gpu`` with ``gib`` GiB of memory (``--gpu-memory``, the explorer's GPU memory field).

    The name stays, so the kind's shipped coefficients and the user's calibration for it
    (keyed by name) still apply; plan output shows the memory beside the name. ValueError
    naming ``what`` unless ``gib`` is a device's size (:func:`memory_bytes`)."""
    return gpu.model_copy(update={"memory_bytes": memory_bytes(gib, what)})


#: The most device memory a GiB figure may give (1 PiB, far beyond any device): more is a typo.
MAX_MEMORY_GIB = 2**20


def memory_bytes(gib: float, what: str, *, least: int = MIB) -> int:
    """``gib`` GiB in bytes; ValueError naming ``what`` unless it is from ``least`` bytes (a device:
    1 MiB) to MAX_MEMORY_GIB."""
    if not least / GIB <= gib <= MAX_MEMORY_GIB:  # NaN fails both
        floor = fmt_bytes(least) if least >= MIB else f"{least} byte{'s' if least > 1 else ''}"
        raise ValueError(f"{what} must be from {floor} to {MAX_MEMORY_GIB:,} GiB, not {gib:g} GiB")
    return int(gib * GIB)


def gpu_for_device(device_name: str) -> GPU | None:
    """The catalog GPU a device reports itself as (``torch.cuda.get_device_properties().name``,
    e.g. "NVIDIA A100-SXM4-40GB", "NVIDIA GeForce RTX 4090"), or None: every word of the
    catalog name must be one of the device's words, so an RTX A6000 is not an RTX-4090 and an
    L40S is not an L4; failing that, the one catalog GPU whose model number (its first word,
    when that has a digit) is (an "H100 PCIe" is the H100-80GB; an A100 that does not say its
    memory is neither A100, an RTX 3090 no RTX-4090)."""
    import re

    def split(name: str) -> list[str]:
        return re.findall(r"[a-z0-9]+", name.lower())

    words = set(split(device_name))
    whole = [gpu for name, gpu in GPUS.items() if set(split(name)) <= words]
    first = [gpu for name, gpu in GPUS.items() if any(c.isdigit() for c in split(name)[0]) and split(name)[0] in words]
    return whole[0] if whole else first[0] if len(first) == 1 else None


class Cluster(BaseModel):
    """The GPUs a run gets: how many, how many per node, which kind."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: GPU
    num_gpus: Annotated[int, Field(ge=1, le=MAX_GPUS, description="Trainer GPUs (ranks) in total.")] = 1
    gpus_per_node: Annotated[int | None, Field(ge=1, description="GPUs per node; None: all on one node.")] = None
    host_memory_per_node_bytes: Annotated[
        int | None,
        Field(
            ge=1,
            description="Host memory (RAM) per node: a plan fits only if every node's host holds its ranks'. "
            "None: the host is reported, not judged.",
        ),
    ] = None

    @model_validator(mode="after")
    def _check(self) -> Cluster:
        per_node = self.gpus_per_node or self.num_gpus
        if self.num_gpus > per_node and self.num_gpus % per_node:
            raise ValueError(
                f"--gpus {self.num_gpus} is not a multiple of --gpus-per-node {per_node}: nodes are assumed identical"
            )
        return self

    @property
    def per_node(self) -> int:
        return min(self.gpus_per_node or self.num_gpus, self.num_gpus)

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_gpus // self.per_node)
