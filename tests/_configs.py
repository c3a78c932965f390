"""Model configs the tests write as config.json files (offline, no weights)."""

from __future__ import annotations

#: A valid tiny Llama config.json: 2 blocks of width 64, 512 positions.
TINY_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 512,
}
