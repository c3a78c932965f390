"""Prompt-completion batches for the offline objectives (SFT, DPO): encoding text and reading
the two layouts a batch may come in.

The trainer's own layout (as GRPO's rollouts): each row is its prompt, left-padded, followed
by its completion and its end-of-sequence token, right-padded; a ``completion_mask`` is 1 on
the completion's tokens. Rows of one prompt then share their prompt columns exactly, so the
shared-prefix forward runs a DPO pair's prompt once. Upstream AgileRL's gyms give the other
layout: right-padded rows with a ``prompt_lengths`` column (the completion starts there).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = ["encode_pairs", "fit_to_length", "check_length", "completion_batch", "BatchError"]


class BatchError(ValueError):
    """A batch without the fields an objective needs, or with fields of the wrong shape."""


def encode_pairs(
    tokenizer,
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    eos_token_id: int | None,
    pad_token_id: int,
    max_len: int | None = None,
    share: int = 1,
) -> dict[str, torch.Tensor]:
    """Tokenize prompt-completion pairs into the trainer's layout: ``input_ids``, ``attention_mask``
    and ``completion_mask`` (the completion and the end-of-sequence token appended to it).

    ``max_len`` caps each row's tokens (:func:`fit_to_length`); ``share`` consecutive rows have
    the same prompt (a preference pair's two) and keep the same prompt tokens.
    """
    if len(prompts) != len(completions):
        raise BatchError(f"{len(prompts)} prompts but {len(completions)} completions")
    if tokenizer is None:
        raise BatchError("text pairs need a tokenizer: pass tokenizer=... or tokenized batches")
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    completion_ids = [
        tokenizer(c, add_special_tokens=False)["input_ids"] + ([eos_token_id] if eos_token_id is not None else [])
        for c in completions
    ]
    if any(not c for c in completion_ids):
        raise BatchError("a completion encodes to no token (and there is no end-of-sequence token to learn)")
    if max_len is not None:
        for i in range(0, len(prompts), share):
            prompt_ids[i : i + share], completion_ids[i : i + share] = fit_to_length(
                prompt_ids[i : i + share], completion_ids[i : i + share], max_len
            )
    width_p = max(len(p) for p in prompt_ids)
    width_c = max(len(c) for c in completion_ids)
    n = len(prompts)
    ids = torch.full((n, width_p + width_c), pad_token_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    completion = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        start = width_p - len(p)
        ids[i, start:width_p] = torch.tensor(p, dtype=torch.long)
        ids[i, width_p : width_p + len(c)] = torch.tensor(c, dtype=torch.long)
        attention[i, start : width_p + len(c)] = 1
        completion[i, width_p : width_p + len(c)] = 1
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def fit_to_length(
    prompts: list[list[int]], completions: list[list[int]], max_len: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Token lists of rows sharing one prompt, cut so each row has at most ``max_len`` tokens.

    The prompt keeps its last tokens (those next to the completion), down to half of
    ``max_len`` where the longest completion needs the room; each completion then keeps its
    first tokens (a cut completion loses its end-of-sequence token: it did not end there).
    Rows that fit are left as they are.
    """
    longest = max(len(c) for c in completions)
    prompt = prompts[0]
    if len(prompt) + longest <= max_len:
        return prompts, completions
    keep = min(len(prompt), max(max_len - longest, max_len // 2))
    cut = prompt[len(prompt) - keep :]
    return [cut] * len(prompts), [c[: max_len - keep] for c in completions]


def check_length(attention: torch.Tensor, max_len: int | None, *, who: str) -> None:
    """Refuse a batch with a row longer than ``max_len`` attended tokens (the length the memory
    plan and the engine are sized for)."""
    if max_len is None or attention.numel() == 0:
        return
    longest = int(attention.sum(dim=1).max())
    if longest > max_len:
        raise BatchError(
            f"{who}: a row has {longest} tokens, over max_model_len={max_len} (the length memory is "
            "planned for): truncate the batch (encode() does) or raise max_model_len"
        )


def completion_batch(
    batch: Mapping[str, torch.Tensor], *, prefix: str = "", who: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, completion_mask)`` of a batch in either layout (module doc).

    ``prefix`` reads the fields of one side of a preference pair (``chosen_``, ``rejected_``).
    ``completion_mask`` is taken as given, else made from ``prompt_lengths`` (the completion is
    every attended token from there on). ``who`` names the caller in errors.
    """
    if not isinstance(batch, Mapping):
        raise BatchError(f"{who} takes a mapping of tensors (see its docstring), got {type(batch).__name__}")
    key = f"{prefix}input_ids"
    if key not in batch:
        raise BatchError(f"{who}: the batch has no {key!r} (it has {sorted(batch)})")
    ids = torch.as_tensor(batch[key])
    if ids.dim() != 2:
        raise BatchError(f"{who}: {key!r} must be [sequences, tokens], got shape {tuple(ids.shape)}")
    attention = batch.get(f"{prefix}attention_mask")
    if attention is None and f"{prefix}completion_mask" not in batch and "prompt_lengths" in batch:
        raise BatchError(
            f"{who}: a batch with 'prompt_lengths' needs {prefix}attention_mask too: its rows are "
            "right-padded, and without the mask the padding would be learnt as completion"
        )
    attention = torch.ones_like(ids) if attention is None else torch.as_tensor(attention)
    mask_key = f"{prefix}completion_mask"
    if mask_key in batch:
        completion = torch.as_tensor(batch[mask_key])
    elif "prompt_lengths" in batch:
        lengths = torch.as_tensor(batch["prompt_lengths"]).reshape(-1, 1)
        if lengths.shape[0] != ids.shape[0]:
            raise BatchError(f"{who}: {lengths.shape[0]} prompt_lengths for {ids.shape[0]} sequences")
        completion = (torch.arange(ids.shape[1]).unsqueeze(0) >= lengths).to(attention.dtype) * attention
    else:
        raise BatchError(
            f"{who}: the batch needs {mask_key!r} (1 on the completion's tokens) or 'prompt_lengths' "
            "(where each row's completion starts); it has neither"
        )
    for name, t in ((f"{prefix}attention_mask", attention), (mask_key, completion)):
        if t.shape != ids.shape:
            raise BatchError(f"{who}: {name!r} has shape {tuple(t.shape)}, {key!r} {tuple(ids.shape)}")
    if not bool(completion[:, 1:].any(dim=1).all()):
        raise BatchError(f"{who}: a row of {key!r} has no completion token to learn (after its first position)")
    return ids.long(), attention.long(), completion.long()
