"""Model families: what fusion needs to know about each architecture, one module each, found by the config's
``model_type`` (`family_of`).

Importing this package registers the built-in families (`registered_families` lists them in import order); a
model type no family registers runs as a Llama-shaped model with a warning at load (`UntestedFamily`).
`position_embeddings`, `layer_queries` and `layer_keys_values` compute a decoder layer's pieces as its family does.
CONTRIBUTING.md walks through adding one.
"""

from kvrag.model.families import (  # noqa: F401  (each import registers its family)
    experts,
    gemma2,
    gemma3,
    gpt_oss,
    granite,
    llama,
    olmo2,
    phi3,
    smollm3,
)
from kvrag.model.families.base import (
    DEFAULT_ROPE,
    Family,
    LayerKind,
    ScoreRule,
    UntestedFamily,
    family_of,
    layer_keys_values,
    layer_queries,
    position_embeddings,
    register_family,
    registered_families,
)

__all__ = ["DEFAULT_ROPE", "Family", "LayerKind", "ScoreRule", "UntestedFamily", "family_of", "layer_keys_values",
           "layer_queries", "position_embeddings", "register_family", "registered_families"]
