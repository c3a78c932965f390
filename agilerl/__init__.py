"""AgileRL LLM runtime: torch-native distributed helpers and the GRPO trainer."""

__version__ = "0.1.0"
