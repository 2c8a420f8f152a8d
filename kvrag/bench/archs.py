"""Published model shapes for ``kvrag bench speed --arch``: each HF ``config.json``'s sizes, as shipped.

Contract: `ARCHS` maps a shape's name to its family and the config fields that size it (rope scaling included);
`kvrag.bench.speed` builds a model of that shape with random weights. Data only: nothing is imported.
"""

from __future__ import annotations

from typing import Any

# Published shapes (HF config.json of each model); rope_scaling as shipped.
ARCHS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        family="llama",
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "qwen2.5-7b": dict(
        family="qwen2",
        num_hidden_layers=28,
        hidden_size=3584,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        rope_theta=1e6,
        max_position_embeddings=131072,
    ),
    "mistral-7b": dict(
        family="mistral",
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=32768,
        rope_theta=1e6,
        max_position_embeddings=131072,
        sliding_window=None,
    ),
    "smollm2-135m": dict(
        family="llama",
        num_hidden_layers=30,
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        rope_theta=1e5,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        family="llama",
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1024,
        max_position_embeddings=131072,
    ),
}
