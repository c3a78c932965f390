"""LLM reinforcement-learning algorithms."""

from .cispo import CISPO
from .grpo import GRPO
from .gspo import GSPO
from .reinforce import LLMREINFORCE

__all__ = ["GRPO", "CISPO", "GSPO", "LLMREINFORCE"]
