"""A tiny reasoning-style task: single-digit arithmetic prompts with answers.

``"3+4="`` asks for ``"7"`` (sums are taken mod 10 so every answer is one
digit). The reward gives partial credit for the format, so a randomly
initialised tiny model has a learning signal:

- 0.2 when the completion starts with a digit,
- +0.2 when it stops right after that digit (end of sequence),
- +1.0 when that digit is the answer.

Maximum 1.4.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["ArithmeticEnv", "arithmetic_reward"]


def arithmetic_reward(completion: str, answer: str, *, stopped: bool) -> float:
    """Reward one completion (text without special tokens) against its answer."""
    text = completion.strip()
    if not text or not text[0].isdigit():
        return 0.0
    reward = 0.2
    if stopped and len(text) == 1:
        reward += 0.2
    if text[0] == answer:
        reward += 1.0
    return reward


@dataclass
class ArithmeticEnv:
    """Samples prompts with answers; the same seed gives the same batches on every rank."""

    seed: int = 0
    operators: str = "+"

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def sample(self, num_prompts: int) -> tuple[list[str], list[str]]:
        prompts, answers = [], []
        for _ in range(num_prompts):
            a, b = self._rng.randrange(10), self._rng.randrange(10)
            op = self._rng.choice(self.operators)
            value = {"+": a + b, "-": a - b, "*": a * b}[op] % 10
            prompts.append(f"{a}{op}{b}=")
            answers.append(str(value))
        return prompts, answers

    def wrong_answers(self, answers: list[str]) -> list[str]:
        """A wrong digit for each answer (the rejected completions of a preference pair), drawn
        from the same generator as the prompts."""
        return [str((int(a) + self._rng.randrange(1, 10)) % 10) for a in answers]

    def get_state(self) -> tuple:
        """The sampling position (the RNG state), for checkpoints."""
        return self._rng.getstate()

    def set_state(self, state) -> None:
        self._rng.setstate(tuple(state) if isinstance(state, list) else state)

    def reward(self, completions: list[str], answers: list[str], stopped: list[bool]) -> list[float]:
        return [arithmetic_reward(c, a, stopped=s) for c, a, s in zip(completions, answers, stopped)]
