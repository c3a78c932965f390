"""LLM fine-tuning algorithms: the RL objectives on GRPO's rollout loop (GRPO, CISPO, GSPO,
LLMREINFORCE, LLMPPO) and the offline ones (SFT, DPO), on one shared base."""

from .cispo import CISPO
from .dpo import DPO
from .grpo import GRPO
from .gspo import GSPO
from .ppo import LLMPPO
from .reinforce import LLMREINFORCE
from .sft import SFT

__all__ = ["GRPO", "CISPO", "GSPO", "LLMREINFORCE", "LLMPPO", "SFT", "DPO"]
