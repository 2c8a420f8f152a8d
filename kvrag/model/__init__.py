"""The model stage: loading a Hugging Face, local or GGUF model, its fingerprint, its family, and RoPE helpers.

What depends on transformers internals lives in `kvrag.model.hf_compat` and in the families
(`kvrag.model.families`, one module per architecture, found by ``model_type``); the rest of kvrag reaches the
model through `LoadedModel` (``LoadedModel.family``) and the helpers re-exported here.
"""

from kvrag.model.loading import (
    LoadedModel,
    ModelSpec,
    apply_rope,
    load_model,
    model_fingerprint,
    rope_at,
    unapply_rope,
    wrap_model,
)

__all__ = ["LoadedModel", "ModelSpec", "apply_rope", "load_model", "model_fingerprint", "rope_at", "unapply_rope",
           "wrap_model"]
