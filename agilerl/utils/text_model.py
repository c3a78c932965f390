"""Export the text model of a multimodal checkpoint, for the trainer to fine-tune.

    python -m agilerl.utils.text_model SOURCE OUT_DIR [--dtype bfloat16]

The trainer fine-tunes decoder-only causal LMs. A multimodal checkpoint (Gemma 3
4B and larger, Mistral Small 3.1/3.2, Gemma 3n) keeps vision or audio encoders
beside its language model; RL on text prompts never runs them, and LoRA's
"all-linear" would adapt them for nothing. This writes the language model and its
head as the text architecture's own checkpoint (``Gemma3ForCausalLM`` for
``Gemma3ForConditionalGeneration``): the same weights, bit for bit, under the key
names the text class loads, plus the tokenizer files. The planner plans exactly
that model (the encoders are not counted), whether it is given the multimodal
checkpoint, its catalog name or the exported directory.

SOURCE is a local directory or a hub id in the local Hugging Face cache; nothing is
downloaded. The whole checkpoint is read into CPU memory once.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from agilerl.utils.cli import ArgumentParser

__all__ = ["export_text_model"]

#: Tokenizer and chat-template files copied next to the exported weights when present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
)


def _source_dir(source: str) -> Path:
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    from agilerl.utils.sources import cached_config

    cached = cached_config(source)
    if cached is None:
        raise ValueError(
            f"{source}: not a local directory and not in the local Hugging Face cache "
            f"(download it first: huggingface-cli download {source})"
        )
    return cached.parent


def export_text_model(source: str, out_dir: str | Path, *, dtype: str = "bfloat16") -> Path:
    """Write the text model of the multimodal checkpoint ``source`` to ``out_dir``; returns it."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from agilerl.distributed import reinit_non_persistent_buffers
    from agilerl.utils.sources import multimodal_architecture, read_config

    folder = _source_dir(source)
    raw = read_config(folder / "config.json")
    arch = multimodal_architecture(raw)
    if arch is None:
        raise ValueError(
            f"{source}: not a multimodal checkpoint (no vision or audio config beside a text_config); "
            "the trainer takes it as it is"
        )
    cls = getattr(transformers, arch, None)
    if cls is None:
        raise ValueError(f"{source}: transformers {transformers.__version__} has no class {arch}")
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"--dtype {dtype!r} is not a torch dtype (bfloat16, float16, float32)")
    full = cls.from_pretrained(folder, dtype=torch_dtype)
    language = getattr(getattr(full, "model", None), "language_model", None)
    head = full.get_output_embeddings()
    if language is None or head is None:
        raise ValueError(f"{source}: {arch} keeps no model.language_model and output head to export")
    text_config = AutoConfig.for_model(**full.config.get_text_config().to_dict())
    text_config.tie_word_embeddings = head.weight is full.get_input_embeddings().weight
    with torch.device("meta"):
        text = AutoModelForCausalLM.from_config(text_config, dtype=torch_dtype)
    text.model.load_state_dict(language.state_dict(), strict=True, assign=True)
    if text_config.tie_word_embeddings:
        text.tie_weights()
    else:
        text.get_output_embeddings().load_state_dict(head.state_dict(), strict=True, assign=True)
    # Non-persistent buffers (rotary tables, embedding scales) are in no state dict: rebuild them on CPU.
    for module in text.modules():
        for key, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                module._buffers[key] = torch.empty_like(buffer, device="cpu")
    reinit_non_persistent_buffers(text)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    text.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copy2(folder / name, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m agilerl.utils.text_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a multimodal checkpoint: local directory or cached hub id")
    parser.add_argument("out_dir", help="where to write the text model")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the written weights (default bfloat16)")
    args = parser.parse_args(argv)
    try:
        out = export_text_model(args.source, args.out_dir, dtype=args.dtype)
    except (ValueError, OSError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote the text model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
