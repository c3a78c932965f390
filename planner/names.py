"""Phase and component names shared by the CLI, the JSON output, the TUI and the probe.

A contract: change a name only deliberately, with its tests (test_phases_and_components_use_the_shared_names in
tests/planner/test_memory.py, and the TUI's and CLI's tests that read them).
"""

PHASES = ("load", "rollout", "reference", "learn", "step", "save", "sync")

#: Device components. Host components are prefixed ``host_``.
COMPONENTS = (
    "weights",  # local base shards (all of them, unsharded)
    "weights_gathered",  # units all-gathered in flight
    "weights_replicated",  # below param_persistence_threshold
    "lora",  # LoRA actor (and reference) adapters, fp32
    "reference_weights",  # full fine-tuning's frozen reference copy (local shards)
    "gradients",
    "optimizer_state",
    "activations",
    "logits",  # the log-prob workspace
    "kv_cache",  # Hugging Face generation
    "vllm",  # a colocated vLLM engine
    "comm_buffers",  # FSDP2's reduce-scatter inputs, the data-parallel all-reduce bucket (tensors)
    "nccl_buffers",  # NCCL communicators' own device memory (outside PyTorch's allocator)
    "cuda_context",
    "cublas_workspace",  # cuBLAS' per-thread workspaces, from the caching allocator
    "allocator_slack",
)

#: Device components no tensor tracker and no ``max_memory_allocated`` sees: the context, the
#: caching allocator's reserve beyond its blocks, NCCL's own buffers. A measured phase's tensors
#: are compared with the estimate less these (0 on a CPU device).
NOT_TENSORS = ("cuda_context", "allocator_slack", "nccl_buffers")
