"""The log-prob head over completion rows only, against every row (CPU, one process).

    python -m benchmarks.head_rows

GRPO's loss reads the completion's log-probs only; ``linear_token_logprobs(...,
first=P - 1)`` skips the prompt's rows. Prints the forward + backward time of the
head (median of 5) for a micro-batch of 4 sequences at several prompt lengths,
completion 128 tokens, hidden 512, vocabulary 32,000, chunks of 1,024 rows, bf16.
"""

from __future__ import annotations

import statistics
import time

import torch

from agilerl.utils.logprobs import linear_token_logprobs


def timed(prompt: int, completion: int, first: int, repeats: int = 5) -> float:
    g = torch.Generator().manual_seed(0)
    length = prompt + completion
    hidden = torch.randn(4, length, 512, generator=g).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(32000, 512, generator=g).to(torch.bfloat16) * 0.02
    targets = torch.randint(0, 32000, (4, length), generator=g)
    times = []
    for _ in range(repeats + 1):
        hidden.grad = None
        start = time.perf_counter()
        out = linear_token_logprobs(hidden, targets, weight, chunk_size=1024, first=first)
        out[:, prompt - 1 :].sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"{'prompt':>7} {'completion':>10} {'all rows ms':>12} {'completion rows ms':>19} {'ratio':>6}")
    for prompt in (64, 256, 1024):
        full = timed(prompt, 128, 0)
        skip = timed(prompt, 128, prompt - 1)
        print(f"{prompt:>7} {128:>10} {full * 1000:>12.1f} {skip * 1000:>19.1f} {skip / full:>6.2f}")


if __name__ == "__main__":
    main()
