"""kvrag: retrieval-augmented generation that never prefills the same chunk twice.

Build an index whose chunks carry their precomputed KV caches, then answer questions by fusing the
retrieved chunks' caches with a selective recompute::

    from kvrag import KVRag
    rag = KVRag.build(["Paris is the capital of France."], "./idx", model="smollm2")
    print(rag.answer("What is the capital of France?", k=1).text)

Heavy dependencies (torch, transformers, faiss) load on first use of `KVRag`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvrag.config import (
    CodecConfig,
    FuseConfig,
    GateConfig,
    GenerateConfig,
    SessionConfig,
    SplitConfig,
    StoreConfig,
)
from kvrag.errors import (
    ChunkNotFoundError,
    CorruptChunkError,
    IndexCorruptError,
    IndexMismatchError,
    IndexNotFoundError,
    InputError,
    KVRagError,
    ModelNotFoundError,
    UnsupportedModelError,
    UntrustedPathError,
)
from kvrag.lazy import lazy_exports

__version__ = "0.1.0"

if TYPE_CHECKING:
    from kvrag.query.answer import Answer, RetrievedChunk
    from kvrag.query.pipeline import FusedPrompt
    from kvrag.rag import KVRag
    from kvrag.repair import RepairReport, repair_index
    from kvrag.storage.verify import VerifyReport, verify_index

_LAZY = {"KVRag": "kvrag.rag", "Answer": "kvrag.query.answer", "RetrievedChunk": "kvrag.query.answer",
         "FusedPrompt": "kvrag.query.pipeline", "verify_index": "kvrag.storage.verify",
         "repair_index": "kvrag.repair", "VerifyReport": "kvrag.storage.verify",
         "RepairReport": "kvrag.repair"}


__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = [
    "Answer", "ChunkNotFoundError", "CodecConfig", "CorruptChunkError", "FuseConfig", "FusedPrompt", "GateConfig",
    "GenerateConfig", "IndexCorruptError", "IndexMismatchError", "UntrustedPathError",
    "IndexNotFoundError", "InputError", "KVRag", "KVRagError", "ModelNotFoundError", "RetrievedChunk", "SplitConfig",
    "RepairReport", "SessionConfig", "StoreConfig", "UnsupportedModelError", "VerifyReport", "__version__",
    "repair_index",
    "verify_index",
]
