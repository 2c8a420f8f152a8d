"""KVSplit: cut documents into chunks under a token budget of the LLM's tokenizer.

Contract, for any ``str`` document with non-whitespace content:

- every chunk is an exact slice, ``chunk.text == document[chunk.start:chunk.end]``;
- chunks are contiguous and non-empty, so ``"".join(c.text for c in chunks) == document``;
- ``chunk.n_tokens`` is the length of ``tokenizer(chunk.text, add_special_tokens=False)`` and never
  exceeds ``SplitConfig.max_tokens`` (measured on the final chunk text, not estimated).

An empty or whitespace-only document has nothing to cache and yields ``[]``.

``"semantic"`` mode segments sentences with NLTK Punkt (the pretrained English ``punkt_tab`` data
when ``nltk.data`` finds it; otherwise Punkt trained unsupervised on the documents being split --
nothing is ever downloaded; the pickled ``punkt`` model is never loaded, since unpickling runs
code). Sentences are grouped greedily; a chunk closes at a paragraph break (blank line) or at a
semantic shift (neighbouring-sentence similarity below ``median - similarity_drop``, when an
embedder is given) once it holds ``min_tokens``, and always before it would exceed the budget.
Whitespace after a sentence belongs to that sentence's chunk. A sentence over budget is cut with
the fixed-token method. ``"fixed"`` mode cuts every ``max_tokens`` tokens at the fast tokenizer's
offsets, then re-tokenizes each piece and shrinks it if BPE merged differently. ``"document"`` mode
keeps a document within budget whole (one chunk) and splits the others as ``"semantic"`` does.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from kvrag.config import SplitConfig
from kvrag.errors import InputError

if TYPE_CHECKING:  # nltk (and the scipy it imports) loads only when a document is split
    from nltk.tokenize.punkt import PunktSentenceTokenizer

logger = logging.getLogger(__name__)

_DEFAULT_CONFIG = SplitConfig()

Embedder = Callable[[list[str]], np.ndarray]
Span = tuple[int, int]

# A blank line (possibly holding spaces, tabs or '\r') and the whitespace after it.
_PARAGRAPH_BREAK = re.compile(r"\n[^\S\n]*\n\s*")


@dataclass(frozen=True)
class Chunk:
    """One chunk of a document: ``text == document[start:end]``, ``n_tokens`` under the LLM."""

    text: str
    start: int
    end: int
    n_tokens: int


@dataclass(frozen=True)
class _Unit:
    """A sentence plus its trailing whitespace; ``para_end`` when a paragraph break follows."""

    start: int
    end: int
    n_tokens: int
    para_end: bool


def _punkt() -> ModuleType:
    """``nltk.tokenize.punkt``, imported the first time a document is split into sentences."""
    # nltk (and the scipy it imports) takes ~3 s to import, and `kvrag ask` imports this module (kvrag.rag imports
    # the builder): it loads only when a document is split into sentences
    from nltk.tokenize import punkt

    return punkt


def load_pretrained_punkt() -> PunktSentenceTokenizer | None:
    """Load the pretrained English Punkt model (``punkt_tab``); ``None`` when it is not installed."""
    try:
        return _punkt().PunktTokenizer("english")
    except LookupError:
        return None


def train_punkt(texts: Sequence[str]) -> PunktSentenceTokenizer:
    """Train Punkt unsupervised on ``texts`` (abbreviations, collocations, sentence starters)."""
    punkt = _punkt()
    trainer = punkt.PunktTrainer()
    for text in texts:
        trainer.train(text, finalize=False)
    trainer.finalize_training()
    return punkt.PunktSentenceTokenizer(trainer.get_params())


class KVSplitter:
    """Splits documents into budgeted, lossless chunks (see the module docstring).

    Args:
        tokenizer: the LLM's Hugging Face *fast* tokenizer (offsets are needed).
        config: mode and token budget.
        embed: optional sentence embedder, ``list[str] -> float32 [n, d]`` with L2-normalised rows;
            in ``"semantic"`` mode it adds semantic-shift boundaries.

    Example:
        >>> splitter = KVSplitter(tokenizer, SplitConfig(max_tokens=128, min_tokens=32))
        >>> chunks = splitter.split(document)
        >>> assert "".join(c.text for c in chunks) == document
    """

    def __init__(
        self, tokenizer, config: SplitConfig = _DEFAULT_CONFIG, embed: Embedder | None = None
    ) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError(
                f"tokenizer must be a Hugging Face fast tokenizer, got {type(tokenizer).__name__}"
            )
        if not isinstance(config, SplitConfig):
            raise TypeError(f"config must be a SplitConfig, got {type(config).__name__}")
        if embed is not None and not callable(embed):
            raise TypeError(f"embed must be callable or None, got {type(embed).__name__}")
        self.tokenizer = tokenizer
        self.config = config
        self.embed = embed
        self._pretrained: PunktSentenceTokenizer | None = None  # loaded once, on first use

    def split(self, text: str) -> list[Chunk]:
        """Split one document.

        Args:
            text: the document; whitespace-only or empty gives ``[]``.

        Returns:
            Contiguous chunks whose texts concatenate to ``text``, each within ``max_tokens``.

        Raises:
            TypeError: ``text`` is not a ``str``.
            InputError: a single character needs more tokens than ``max_tokens``.
        """
        _check_text(text, "text")
        return self.split_many([text])[0]

    def split_many(self, texts: Sequence[str]) -> list[list[Chunk]]:
        """Split several documents; without pretrained Punkt data, Punkt is trained once on all.

        Args:
            texts: the documents (a sequence of ``str``, not a single ``str``).

        Returns:
            One chunk list per document, as :meth:`split` returns.

        Raises:
            TypeError: ``texts`` is a ``str`` or not a sequence, or one of its items is not a ``str``.
            InputError: a single character needs more tokens than ``max_tokens``.
        """
        if isinstance(texts, str) or not isinstance(texts, Sequence):
            raise TypeError(f"texts must be a sequence of str, got {type(texts).__name__}")
        for i, text in enumerate(texts):
            _check_text(text, f"texts[{i}]")
        if self.config.mode == "fixed":
            return [self._split_fixed(text) for text in texts]
        done = self._whole(texts) if self.config.mode == "document" else [None] * len(texts)
        todo = [t for t, d in zip(texts, done, strict=True) if d is None and t.strip()]
        punkt = self._punkt(todo) if todo else None
        pairs = zip(texts, done, strict=True)
        return [d if d is not None else self._split_semantic(t, punkt) for t, d in pairs]

    def _whole(self, texts: Sequence[str]) -> list[list[Chunk] | None]:
        """Document mode: each document within budget as one chunk; ``None`` for the others."""
        out: list[list[Chunk] | None] = []
        for text, n in zip(texts, self._count(list(texts)), strict=True):
            if not text.strip():
                out.append([])
            else:
                out.append([Chunk(text, 0, len(text), n)] if n <= self.config.max_tokens else None)
        return out

    # -- semantic mode ---------------------------------------------------------------------------

    def _punkt(self, texts: list[str]) -> PunktSentenceTokenizer:
        if self._pretrained is None:
            self._pretrained = load_pretrained_punkt()
        if self._pretrained is not None:
            return self._pretrained
        logger.info("no pretrained Punkt data; training Punkt on %d documents", len(texts))
        return train_punkt(texts)

    def _split_semantic(self, text: str, punkt: PunktSentenceTokenizer | None) -> list[Chunk]:
        if not text.strip():
            return []
        assert punkt is not None, "Punkt is loaded for every document with content"
        sentences = _sentence_spans(text, punkt)
        units = self._units(text, sentences)
        shifts = self._semantic_shifts(text, sentences)
        chunks: list[Chunk] = []
        group: list[_Unit] = []
        total = 0
        for i, unit in enumerate(units):
            oversized = unit.n_tokens > self.config.max_tokens
            if group and (oversized or total + unit.n_tokens > self.config.max_tokens):
                chunks += self._fit(text, group)
                group, total = [], 0
            if oversized:
                chunks += self._fixed_chunks(text, unit.start, unit.end)
                continue
            group.append(unit)
            total += unit.n_tokens
            if total >= self.config.min_tokens and (unit.para_end or shifts[i]):
                chunks += self._fit(text, group)
                group, total = [], 0
        return chunks + self._fit(text, group)

    def _units(self, text: str, sentences: list[tuple[int, int, bool]]) -> list[_Unit]:
        """Widen sentences to tile ``text``.

        Each unit runs from its sentence's start (0 for the first) to the next one's start, so the
        whitespace after a sentence belongs to it.
        """
        starts = [0] + [s for s, _, _ in sentences[1:]]
        ends = starts[1:] + [len(text)]
        counts = self._count([text[a:b] for a, b in zip(starts, ends, strict=True)])
        paras = [para for _, _, para in sentences]
        rows = zip(starts, ends, counts, paras, strict=True)
        return [_Unit(a, b, n, para) for a, b, n, para in rows]

    def _semantic_shifts(self, text: str, sentences: list[tuple[int, int, bool]]) -> list[bool]:
        """``shifts[i]``: the similarity of sentences i and i+1 drops below median - drop."""
        shifts = [False] * len(sentences)
        if self.embed is None or len(sentences) < 3:
            return shifts
        emb = np.asarray(self.embed([text[s:e] for s, e, _ in sentences]), dtype=np.float32)
        if emb.ndim != 2 or emb.shape[0] != len(sentences):
            raise ValueError(f"embed must return an array of shape [{len(sentences)}, d], got {emb.shape}")
        emb = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)  # [n, d], a copy
        sims = np.einsum("nd,nd->n", emb[:-1], emb[1:])  # [n-1]
        below = sims < float(np.median(sims)) - self.config.similarity_drop
        return below.tolist() + [False]

    def _fit(self, text: str, group: list[_Unit]) -> list[Chunk]:
        """Turn a group of units into chunks, each measured exactly.

        BPE can merge across unit boundaries, so a group whose summed estimate fit but whose real
        count does not sheds trailing units into a further chunk.
        """
        chunks: list[Chunk] = []
        while group:
            k = len(group)
            n = self._count_one(text[group[0].start : group[-1].end])
            while n > self.config.max_tokens and k > 1:
                k -= 1
                n = self._count_one(text[group[0].start : group[k - 1].end])
            assert n <= self.config.max_tokens, "a single unit within budget re-measured over it"
            start, end = group[0].start, group[k - 1].end
            chunks.append(Chunk(text[start:end], start, end, n))
            group = group[k:]
        return chunks

    # -- fixed mode ------------------------------------------------------------------------------

    def _split_fixed(self, text: str) -> list[Chunk]:
        return self._fixed_chunks(text, 0, len(text)) if text.strip() else []

    def _fixed_chunks(self, text: str, start: int, end: int) -> list[Chunk]:
        """``text[start:end]`` cut every ``max_tokens`` tokens, each piece re-measured.

        Cuts are proposed at token starts of one tokenization of the span; a piece that re-tokenizes
        over budget (BPE merges differ at a cut) backs its cut off, and the next piece starts there.
        """
        offsets = self._offsets(text[start:end])
        bounds = [start] + [start + a for a, _ in offsets[1:]] + [end]  # bounds[i]: token i starts
        chunks: list[Chunk] = []
        i = 0
        while bounds[i] < end:
            j = min(i + self.config.max_tokens, len(bounds) - 1)
            chunk, i = self._fitting_piece(text, bounds, i, j)
            chunks.append(chunk)
        return chunks

    def _fitting_piece(self, text: str, bounds: list[int], i: int, j: int) -> tuple[Chunk, int]:
        """Return the piece ``[bounds[i], bounds[k])`` for the largest ``k <= j`` within budget, and k."""
        a = bounds[i]
        while j > i:
            b = bounds[j]
            n = self._count_one(text[a:b]) if b > a else self.config.max_tokens + 1
            if n <= self.config.max_tokens:
                return Chunk(text[a:b], a, b, n), j
            j -= max(1, n - self.config.max_tokens) if b > a else 1
        raise InputError(
            f"the character at offset {a} ({text[a]!r}) needs more than "
            f"max_tokens={self.config.max_tokens} tokens; raise SplitConfig.max_tokens"
        )

    # -- tokenizer access ------------------------------------------------------------------------

    def _count(self, texts: list[str]) -> list[int]:
        if not texts:
            return []
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [len(x) for x in ids]

    def _count_one(self, text: str) -> int:
        return self._count([text])[0]

    def _offsets(self, text: str) -> list[Span]:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return enc["offset_mapping"]


def _check_text(text: object, name: str) -> None:
    if not isinstance(text, str):
        raise TypeError(f"{name} must be str, got {type(text).__name__}")


def _sentence_spans(text: str, punkt: PunktSentenceTokenizer) -> list[tuple[int, int, bool]]:
    """``(start, end, ends_paragraph)`` of each sentence; a paragraph break always ends one."""
    sentences: list[tuple[int, int, bool]] = []
    for para_start, para_end in _paragraph_spans(text):
        local = punkt.span_tokenize(text[para_start:para_end])
        spans = [(para_start + a, para_start + b) for a, b in local]
        spans = [(a, b) for a, b in spans if text[a:b].strip()]
        sentences += [(a, b, i == len(spans) - 1) for i, (a, b) in enumerate(spans)]
    if sentences:
        sentences[-1] = (*sentences[-1][:2], False)
    return sentences


def _paragraph_spans(text: str) -> list[Span]:
    """Spans of the non-blank paragraphs of ``text`` (separated by blank lines)."""
    bounds = [0]
    for m in _PARAGRAPH_BREAK.finditer(text):
        bounds += [m.start(), m.end()]
    bounds.append(len(text))
    pairs = zip(bounds[0::2], bounds[1::2], strict=True)
    return [(a, b) for a, b in pairs if text[a:b].strip()]
