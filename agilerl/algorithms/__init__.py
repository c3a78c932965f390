"""LLM reinforcement-learning algorithms."""

from .grpo import GRPO

__all__ = ["GRPO"]
