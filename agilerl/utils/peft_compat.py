"""PEFT beside transformers 5: what the pair prints that is no user's concern."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["quiet_peft"]


@contextmanager
def quiet_peft() -> Iterator[None]:
    """Run PEFT (``get_peft_model``, ``add_adapter``) without the FutureWarning transformers 5
    raises when PEFT asks a model for ``is_gradient_checkpointing``: it is about PEFT's code, not
    the caller's, and every adapter build repeated it. Other warnings still show."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        yield
