import os
import tempfile

# Before transformers and peft: hides extension packages that cannot load (agilerl/_extensions.py).
import agilerl  # noqa: F401

# Tests never reach the network; tiny models and tokenizers are built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# Built-in tiny models are written to a cache; keep it out of the user's home.
# Inherited by the torchrun workers the multi-rank tests launch.
os.environ.setdefault("AGILERL_CACHE", tempfile.mkdtemp(prefix="agilerl-test-cache-"))
