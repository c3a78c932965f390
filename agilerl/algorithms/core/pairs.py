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
) -> dict[str, torch.Tensor]:
    """Tokenize prompt-completion pairs into the trainer's layout: ``input_ids``, ``attention_mask``
    and ``completion_mask`` (the completion and the end-of-sequence token appended to it).

    ``max_len`` caps the batch's width (:func:`fit_to_length`).
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
        prompt_ids, completion_ids = fit_to_length(prompt_ids, completion_ids, max_len)
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
    """Token lists cut so the batch is at most ``max_len`` wide in the trainer's layout (the
    longest prompt plus the longest completion: the width memory is planned for).

    Prompts keep their last tokens (those next to the completion), up to what the longest
    completion leaves but never fewer than half of ``max_len``; completions keep their first
    tokens within the rest (a cut completion loses its end-of-sequence token: it did not end
    there). Equal prompts are cut alike, so a preference pair keeps sharing its prompt; a batch
    that fits is left as it is.
    """
    longest_prompt, longest_completion = max(map(len, prompts)), max(map(len, completions))
    if longest_prompt + longest_completion <= max_len:
        return prompts, completions
    prompt_room = min(longest_prompt, max(max_len - longest_completion, max_len // 2))
    completion_room = max_len - prompt_room
    return [p[max(0, len(p) - prompt_room) :] for p in prompts], [c[:completion_room] for c in completions]


def check_length(ids: torch.Tensor, max_len: int | None, *, who: str) -> None:
    """Refuse a batch wider than ``max_len`` tokens, padding included (the width memory is
    planned for)."""
    if max_len is not None and ids.shape[1] > max_len:
        raise BatchError(
            f"{who}: the batch is {ids.shape[1]} tokens wide (padding included), over max_model_len="
            f"{max_len} (the length memory is planned for): truncate it (encode() does) or raise max_model_len"
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
