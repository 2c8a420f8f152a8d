"""A sentence-transformers folder of a transformer, mean pooling and normalisation, run with transformers alone.

Contract: `is_mean_pooled(folder)` says whether a local sentence-transformers folder is exactly that pipeline
(``modules.json``: a ``Transformer``, a ``Pooling`` that averages the token embeddings and nothing else, and
optionally ``Normalize``), such as the default embedder, all-MiniLM-L6-v2. `MeanPooledEncoder` loads such a folder
(a plain BERT, the default's, with `kvrag.native_bert` and kvrag's own tokenizer, `kvrag.model.native_tokenizer`,
so that embedding imports no transformers; any other with `transformers.AutoModel` and `AutoTokenizer`)
and embeds as sentence-transformers does: texts tokenized with padding and truncation at the folder's
``max_seq_length``, the last hidden states averaged over the attention mask, each row scaled to unit length
(``normalize_embeddings``, or always with ``Normalize``). Its embeddings equal sentence-transformers' to float
rounding (`tests/test_mean_pooled.py`). It exists because importing sentence-transformers (and the scikit-learn it
pulls in) costs about half a second of a cold ``kvrag ask``; any other folder or hub name is loaded by
sentence-transformers itself (`kvrag.embedder`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from kvrag.model.native_tokenizer import load_fast_tokenizer
from kvrag.native_bert import NativeBert, native_bert_reason

_TRANSFORMER = "sentence_transformers.models.Transformer"
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"
_POOL_MODES = ("pooling_mode_cls_token", "pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
               "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")


def _read(path: Path) -> Any:
    return json.loads(path.read_text())


def _read_optional(path: Path) -> Any:
    """``path``'s JSON, or an empty dict when the folder has no such file."""
    return _read(path) if path.is_file() else {}


def is_mean_pooled(folder: str | Path) -> bool:
    """Whether ``folder`` is a local sentence-transformers model of a transformer, mean pooling and (optionally)
    normalisation, with no prompts or options this module does not apply.
    """
    root = Path(folder)
    try:
        modules = _read(root / "modules.json")
        types = [m["type"] for m in modules]
        if types not in ([_TRANSFORMER, _POOLING], [_TRANSFORMER, _POOLING, _NORMALIZE]) or modules[0]["path"]:
            return False
        pooling = _read(root / modules[1]["path"] / "config.json")
        settings = _read_optional(root / "sentence_bert_config.json")
        extra = _read_optional(root / "config_sentence_transformers.json")
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False
    mean_only = pooling.get("pooling_mode_mean_tokens") is True and not any(pooling.get(m) for m in _POOL_MODES)
    plain = not settings.get("do_lower_case") and not extra.get("prompts") and not extra.get("default_prompt_name")
    return mean_only and plain and pooling.get("include_prompt", True) is True


class MeanPooledEncoder:
    """The model of `is_mean_pooled` folder ``folder``, with sentence-transformers' ``encode`` for what kvrag uses."""

    def __init__(self, folder: str | Path, device: str | None = None) -> None:
        root = Path(folder)
        settings = _read_optional(root / "sentence_bert_config.json")
        self.normalize = _NORMALIZE in [m["type"] for m in _read(root / "modules.json")]
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model: Any
        if native_bert_reason(root) is None:  # transformers' BERT modules cost a cold process ~2.5 s to import
            self.tokenizer = load_fast_tokenizer(root)
            self.model = NativeBert.load(root).to(self.device)
        else:
            # lazy: transformers' auto classes cost a cold process 0.3 s to import; a native BERT does not need them
            from transformers import AutoModel, AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(root)
            self.model = AutoModel.from_pretrained(root).to(self.device).eval()
        self.max_length = int(settings.get("max_seq_length") or self.tokenizer.model_max_length)

    def get_embedding_dimension(self) -> int:
        """The embedding width (the transformer's hidden size)."""
        return int(self.model.config.hidden_size)

    def encode(self, texts: Sequence[str], batch_size: int = 32, show_progress_bar: bool = False,
               convert_to_numpy: bool = True, normalize_embeddings: bool = False) -> np.ndarray:
        """float32 ``[n, dim]`` embeddings of ``texts`` (``convert_to_numpy`` is always honoured: numpy rows)."""
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))  # similar lengths share a batch's padding
        out = np.zeros((len(texts), self.get_embedding_dimension()), dtype=np.float32)
        starts = range(0, len(texts), batch_size)
        for start in tqdm(starts, desc="Batches", disable=not show_progress_bar):
            picked = order[start: start + batch_size]
            batch = self.tokenizer([texts[i] for i in picked], padding=True, truncation="longest_first",
                                   max_length=self.max_length, return_tensors="pt").to(self.device)
            with torch.no_grad():
                hidden = self.model(**batch).last_hidden_state  # [b, n, dim]
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [b, n, 1]
            rows = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # [b, dim]
            if self.normalize or normalize_embeddings:
                rows = torch.nn.functional.normalize(rows, p=2, dim=1)
            out[picked] = rows.float().cpu().numpy()
        return out
