"""Which passages of a flat prompt a passage cache reads, and which it stores after the answer.

Contract: `look_up(keys, tokenizer, passage_ids, prompt, texts)` returns, in prompt order, the passages of ``texts``
found in ``prompt`` whose caches are stored (`RetrievedChunk`, ``in_place`` when their rows were computed after
exactly the tokens before them here), the passages whose rows here are to be stored after the answer
(`MissingPassage`: the others, and those found but not in place, ``elsewhere``, stored in place only from an exact
pass), how many passages were looked up, and how each found one was reached (`FoundPassage`, for
`kvrag.passages.keys.PassageKeys.keep` after the answer).

A passage is looked up by its tokens in the prompt (`kvrag.query.prompt_tokens`: after ``"Context: "`` its first
word carries the space), else by its own tokens when enough of them meet those (`kvrag.query.prompt_tokens.align`;
the prompt then reads the rows that match, `kvrag.query.locate`). A passage found in neither is stored as the
prompt has it. A passage is read, first found first: from rows computed after exactly the tokens before it here
(in place: no recompute needed, `kvrag.query.pipeline.LaidOut.in_place`), from rows computed after the same passage
before it (`kvrag.passages.keys.PassageKeys.key`'s ``after``), from a cache computed alone (or first in its
prompt), or, ``anywhere`` (an answer that fuses), from rows some prompt computed after other text before it
(``seen``). A passage with none is recomputed with the prompt, and its rows here are stored after the answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from kvrag.passages.keys import PassageKeys
from kvrag.passages.pending import FoundPassage, MissingPassage
from kvrag.passages.prompt_rows import context_digest
from kvrag.query.answer import RetrievedChunk
from kvrag.query.prompt_tokens import align, tokenize_prompt
from kvrag.query.spans import find_chunk_spans


def look_up(keys: PassageKeys, tokenizer: Any, passage_ids: Callable[[str], list[int]], prompt: str,
            texts: Iterable[str], anywhere: bool = False,
            ) -> tuple[list[RetrievedChunk], list[MissingPassage], int, list[FoundPassage]]:
    """The passages found stored, those to store after the answer, the number looked up, and how each found one was
    reached (the contract).
    """
    texts = list(dict.fromkeys(t.strip() for t in texts if t.strip() and t.strip() in prompt))
    tokens = tokenize_prompt(tokenizer, prompt)
    places: dict[str, tuple[int, int]] = {}
    for span in find_chunk_spans(prompt, [RetrievedChunk("", t, math.nan, "", "prompt", 0) for t in texts]):
        if tokens is not None and (cover := tokens.cover(span.start, span.end)) is not None:
            places.setdefault(span.chunk.text, cover)
    found: list[RetrievedChunk] = []
    missing: list[MissingPassage] = []
    reached: list[FoundPassage] = []
    before: tuple[int, ...] = ()
    for seq, text in enumerate(sorted(texts, key=prompt.find)):  # in prompt order
        own, place = passage_ids(text), places.get(text)
        ids = own if tokens is None or place is None else tokens.ids[place[0]:place[1]]
        context = None if tokens is None or place is None else context_digest(tokens.ids[:place[0]])
        key = None if context is None else keys.stored(ids, context=context)
        in_place = key is not None
        if key is None and before:
            key = keys.stored(ids, before)  # rows computed after the same passage
        prompt_rows = key is not None  # in place or after the same passage: rows a prompt's pass computed
        key = key or keys.stored(ids)
        if key is None and anywhere:
            key = keys.stored(ids, seen=True)
            prompt_rows = key is not None
        here = tuple(ids)  # its tokens in this prompt (or its own, where the prompt has no run of them)
        if key is None and ids != own and align(ids, own)[0] and (plain := keys.stored(own)):
            ids, key = own, plain
        if key is not None:
            found.append(RetrievedChunk(key, text, math.nan, "", "prompt", seq, tuple(ids), in_place))
            reached.append(FoundPassage(tuple(ids), before, key, prompt_rows))
        if key is None or (not in_place and context is not None):  # the prompt may read it in place next time
            missing.append(MissingPassage(text, here, before, elsewhere=key is not None))
        before = tuple(ids)
    return found, missing, len(texts), reached
