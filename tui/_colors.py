"""A fixed colour per memory component (planner.names.COMPONENTS), for the bars and tables."""

from __future__ import annotations

__all__ = ["COMPONENT_COLORS", "OVER_COLOR", "color_of"]

COMPONENT_COLORS: dict[str, str] = {
    "weights": "#4e79a7",
    "weights_gathered": "#a0cbe8",
    "weights_replicated": "#2f5f8a",
    "lora": "#59a14f",
    "reference_weights": "#76b7b2",
    "gradients": "#8cd17d",
    "optimizer_state": "#f28e2b",
    "activations": "#edc948",
    "logits": "#ff9da7",
    "kv_cache": "#b07aa1",
    "vllm": "#d4a6c8",
    "comm_buffers": "#86bcb6",
    "nccl_buffers": "#499894",
    "cuda_context": "#bab0ac",
    "cublas_workspace": "#9d7660",
    "allocator_slack": "#79706e",
}
#: Bytes over the GPU's capacity.
OVER_COLOR = "#ff3b30"


def color_of(component: str) -> str:
    """The component's colour; an unknown (newer) component gets a neutral grey, not an error."""
    return COMPONENT_COLORS.get(component, "#999999")
