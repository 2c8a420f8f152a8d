"""Exact rows for passages that keep coming back fused: one full prefill of their prompt, after the answer.

A passage cache stores rows in place (`kvrag.passages.keys`) only from a pass that read no stored cache: rows a
fused pass computed attended to stored caches, not to the prompt. So a prompt whose passages were stored elsewhere
(warmed, or first seen after other text) is fused each time it comes back and never reaches the in-place path.

Contract:

- `ExactPasses.after(prompt, missing)` is told, after an answer that read stored caches not in place, the passages
  of that prompt still without in-place rows (`MissingPassage`, in prompt order). On its own background thread
  (`BackgroundWork`) it tokenizes the prompt as a full prefill does (`kvrag.query.prompt_tokens`) and counts the
  *run*: the prompt's tokens through the last such passage, which are all that their in-place rows depend on.
  When a run has come back `EXACT_AFTER` times it prefills those tokens (`prompt_pass`) and hands the passages,
  with that pass as their source and marked exact, to ``store`` (the cache's own storing step), which keys each
  passage's rows by the tokens before it and links them after the passage before. The next prompt with that run
  (the same prompt, or under a template that puts the passages first, the same passages under a new question)
  reads them in place.
- Why the second time: most prompts of a stream never come back, and an exact pass costs one prefill of the run.
  A run seen twice is one that recurs; from its third answer on, its passages are read in place.
- `prompt_pass(lm, ids, lock, slice_tokens)` runs the prefill in slices of at most ``slice_tokens`` (the model's
  lock taken for each slice only, so an answer waits for one slice at most) and returns it as a `PromptPass`:
  a full prefill's rows, slicing aside (the tolerance chunked prefill is held to).
- Runs are counted in a bounded memory (`RUNS_KEPT`, least recently seen forgotten). `flush` and `close` are
  `BackgroundWork`'s: `flush` returns once every pass asked for before it has been stored.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from kvrag.byte_lru import ByteLRU
from kvrag.model import LoadedModel, hf_compat
from kvrag.passages.background import BackgroundWork
from kvrag.passages.pending import MissingPassage
from kvrag.passages.prompt_rows import PromptPass, context_digest, find_run
from kvrag.query.prompt_tokens import tokenize_prompt

EXACT_AFTER = 2  # answers over the same run, read from caches stored elsewhere, before its exact pass
RUNS_KEPT = 4096  # runs whose answers are counted


def prompt_pass(lm: LoadedModel, ids: Sequence[int], lock: threading.RLock, slice_tokens: int) -> PromptPass:
    """Prefill ``ids`` in slices of at most ``slice_tokens``, holding ``lock`` for one slice at a time."""
    tokens = torch.tensor([int(t) for t in ids], dtype=torch.long, device=lm.device)
    base, cache = hf_compat.base_model(lm.model), hf_compat.full_cache(lm.model)
    for start in range(0, len(tokens), slice_tokens):
        with lock, torch.no_grad():
            out = base(input_ids=tokens[None, start:start + slice_tokens], **hf_compat.with_cache(base, cache),
                       use_cache=True)
            cache = hf_compat.returned_cache(out)
    return [int(t) for t in ids], hf_compat.cache_layers(cache)


class ExactPasses:
    """Counts runs of passages answered from caches stored elsewhere; prefills a run that comes back (see the
    module contract).

    Args:
        lm: the model.
        lock: the lock that serializes the model's passes.
        store: takes the passages of a run with its exact pass as their source, to be stored (the passage cache's
            writer, which stores every passage on one thread).
        slice_tokens: the most tokens prefilled while holding ``lock``.
    """

    def __init__(self, lm: LoadedModel, lock: threading.RLock, store: Callable[[list[MissingPassage]], object],
                 slice_tokens: int) -> None:
        self.lm, self._lock, self._store, self.slice_tokens = lm, lock, store, slice_tokens
        self._seen: ByteLRU[str, int] = ByteLRU(RUNS_KEPT)  # run digest -> answers counted (one "byte" each)
        self.passes = 0  # exact passes run
        self._work: BackgroundWork[tuple[str, list[MissingPassage]]] = BackgroundWork(self._run, "kvrag-exact-rows")

    def after(self, prompt: str, missing: Sequence[MissingPassage]) -> None:
        """Count ``prompt``'s run of ``missing`` passages, off the caller's thread; prefill it when it came back."""
        if missing:
            self._work.submit([(prompt, list(missing))])

    def _run(self, jobs: list[tuple[str, list[MissingPassage]]]) -> None:
        for prompt, missing in jobs:
            ids = self._run_ids(prompt, missing)
            if ids is None:
                continue
            run = context_digest(ids)
            count = (self._seen.get(run) or 0) + 1
            self._seen.put(run, count, 1)
            if count == EXACT_AFTER:
                source = prompt_pass(self.lm, ids, self._lock, self.slice_tokens)
                self.passes += 1
                self._store([replace(m, source=source, exact=True) for m in missing])

    def _run_ids(self, prompt: str, missing: Sequence[MissingPassage]) -> list[int] | None:
        """The prompt's tokens (as a full prefill has them) through its last missing passage; None where a passage's
        tokens are not found in order.
        """
        tokens = tokenize_prompt(self.lm.tokenizer, prompt)
        if tokens is None:
            return None
        end = 0
        for m in missing:
            at = find_run(tokens.ids, m.ids, end)
            if at is None:
                return None
            end = at + len(m.ids)
        return tokens.ids[:end]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the passes asked for so far are run and handed to ``store``."""
        return self._work.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Run what is queued, then stop the thread."""
        self._work.close(timeout)
