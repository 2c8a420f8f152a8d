"""Decoding steps of several answers run as one pass (`StepBatch`) give what each answer's own steps give."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from kvrag.config import GenerateConfig
from kvrag.generation import step_batch
from kvrag.generation.decode import decode_tokens
from kvrag.model import hf_compat

PROMPT_LENGTHS = (9, 23, 40)
CONFIG = GenerateConfig(max_new_tokens=6, temperature=0)


def _prefilled(model, n: int, seed: int):
    ids = torch.randint(3, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
    cache = hf_compat.full_cache(model)
    with torch.no_grad():
        out = model(ids[None], use_cache=True, **hf_compat.with_cache(model, cache))
    return hf_compat.returned_cache(out), out.logits[0, -1].float()


def _alone(model) -> list[tuple[list[int], list[float]]]:
    results = []
    for seed, n in enumerate(PROMPT_LENGTHS):
        cache, logits = _prefilled(model, n, seed)
        logprobs: list[float] = []
        results.append((list(decode_tokens(model, cache, logits, n, CONFIG, set(), logprobs)), logprobs))
    return results


def _interleaved(model, batch: step_batch.StepBatch) -> list[tuple[list[int], list[float]]]:
    """Each answer one token at a time in turn, the batch run before every round (as `kvrag serve`'s worker)."""
    streams, results = [], []
    with step_batch.installed(batch):
        for seed, n in enumerate(PROMPT_LENGTHS):
            cache, logits = _prefilled(model, n, seed)
            results.append(([], []))
            streams.append(decode_tokens(model, cache, logits, n, CONFIG, set(), results[-1][1]))
        live = list(range(len(streams)))
        while live:
            batch.run()
            for i in list(live):
                token = next(streams[i], None)
                if token is None:
                    live.remove(i)
                else:
                    results[i][0].append(token)
    return results


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_steps_run_together_give_each_answers_own_tokens_and_logprobs(arch: str):
    model = tiny_model(arch)
    batch = step_batch.StepBatch()
    together, alone = _interleaved(model, batch), _alone(model)
    assert [tokens for tokens, _ in together] == [tokens for tokens, _ in alone]
    for (_, got), (_, want) in zip(together, alone):
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-4
    # every step after the first token of each answer, but the last round's, ran in a shared pass
    assert batch.batched_steps >= len(PROMPT_LENGTHS) * (CONFIG.max_new_tokens - 1) - 1 and batch.passes > 0


def _model_forward(model) -> list[tuple[list[int], list[float]]]:
    """Each answer's greedy tokens and log-probabilities from the model's own forward, step by step."""
    results = []
    for seed, n in enumerate(PROMPT_LENGTHS):
        cache, logits = _prefilled(model, n, seed)
        tokens, logprobs = [], []
        for pos in range(n, n + CONFIG.max_new_tokens):
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
            with torch.no_grad():
                out = model(torch.tensor([[token]]), position_ids=torch.tensor([[pos]]), use_cache=True,
                            **hf_compat.with_cache(model, cache))
            cache, logits = hf_compat.returned_cache(out), out.logits[0, -1].float()
        results.append((tokens, logprobs))
    return results


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_step_alone_gives_the_models_own_forward(arch: str):
    """A step alone runs kvrag's layer pass with its rows written into the cache's room: what the model's own forward
    (transformers' cache, concatenating) gives, to float rounding."""
    model = tiny_model(arch)
    alone, own = _alone(model), _model_forward(model)
    assert [tokens for tokens, _ in alone] == [tokens for tokens, _ in own]
    for (_, got), (_, want) in zip(alone, own):
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-4


def test_an_answer_that_ends_at_a_yield_leaves_its_cache_without_the_untaken_step():
    model = tiny_model("llama")
    batch = step_batch.StepBatch()
    with step_batch.installed(batch):
        cache, logits = _prefilled(model, 12, 0)
        other_cache, other_logits = _prefilled(model, 20, 1)
        stream = decode_tokens(model, cache, logits, 12, CONFIG, set())
        other = decode_tokens(model, other_cache, other_logits, 20, CONFIG, set())
        next(stream), next(other)  # both announce their next steps
        stream.close()  # its client went away
        assert batch.run() == 0  # the other step alone is left to run by itself
        next(other)
    assert cache.get_seq_length() == 12 and other_cache.get_seq_length() == 21


def test_a_model_with_windowed_layers_steps_alone_with_the_same_tokens():
    model = tiny_model("gemma2")
    batch = step_batch.StepBatch()
    together, alone = _interleaved(model, batch), _alone(model)
    assert [tokens for tokens, _ in together] == [tokens for tokens, _ in alone]
    assert batch.batched_steps == 0
