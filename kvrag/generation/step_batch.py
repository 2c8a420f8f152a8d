"""`StepBatch`: the next decoding step of several answers run as one forward pass.

Contract: a thread that interleaves answers (`kvrag serve`'s worker) installs a `StepBatch` (`installed`).
`kvrag.generation.decode.decode_tokens` then announces each step it is about to take (its cache, token and
position) before it yields the token, and on resuming takes the step's logits if `StepBatch.run` computed them
meanwhile, or computes the step alone. `run` computes every announced step of a model whose layers kvrag runs
from their parts (`kvrag.model.llama_layer.runs_plain`, no sliding window, caches that keep every row) in one
pass: the projections and MLPs over all of the answers' tokens at once (the weights read once, not once per
answer), the attention of each over its own cache. The logits equal each step's own forward to float rounding
(`tests/test_step_batch.py`). A step whose answer ends without resuming (a stop string, a client gone) is
withdrawn, so no cache grows by a token its answer never took. A step `run` did not compute is computed alone
(`StepBatch.alone`). Every pass, together or alone, is recorded as ``(steps, seconds)`` in ``rounds`` until taken
(`take_rounds`): what a round of ``n`` answers' tokens costs (the weights are read once whatever ``n``).

Layout: hidden states ``[B, 1, hidden]``; heads ``[B, heads, 1, head_dim]``; logits ``[vocab]`` float32 per step.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvrag.generation import layer_steps
from kvrag.generation.cache_room import append_rows, appendable
from kvrag.model import hf_compat, llama_layer
from kvrag.model.cpu_linear import linear
from kvrag.model.families import family_of

_local = threading.local()


@dataclass
class _Step:
    model: Any
    cache: Any
    token: int
    position: int


class StepBatch:
    """Announced decoding steps, run together by `run` and taken back one by one (see the module's contract)."""

    def __init__(self) -> None:
        self._pending: dict[object, _Step] = {}
        self._done: dict[object, torch.Tensor] = {}
        self.batched_steps = 0  # steps computed together, over this batch's life
        self.passes = 0  # forward passes `run` made
        self.rounds: list[tuple[int, float]] = []  # (steps, seconds) of each pass since `take_rounds`

    def announce(self, key: object, model: Any, cache: Any, token: int, position: int) -> None:
        """The step ``key`` is about to take: ``token`` at ``position`` over ``cache`` (which the step extends)."""
        self._pending[key] = _Step(model, cache, token, position)

    def withdraw(self, key: object) -> None:
        """Forget step ``key`` (its answer ended without taking it)."""
        self._pending.pop(key, None)
        self._done.pop(key, None)

    def take(self, key: object) -> torch.Tensor | None:
        """Step ``key``'s logits if `run` computed them (its cache then holds the token's row); else None, and the
        step is no longer announced (its caller computes it alone).
        """
        self._pending.pop(key, None)
        return self._done.pop(key, None)

    def run(self) -> int:
        """Compute the announced steps that can run together, one pass per model; how many were computed."""
        by_model: dict[int, list[tuple[object, _Step]]] = {}
        for key, step in self._pending.items():
            if batchable(step.model, step.cache):
                by_model.setdefault(id(step.model), []).append((key, step))
        computed = 0
        for group in by_model.values():
            if len(group) < 2:  # alone, it runs its own forward when taken
                continue
            began = time.perf_counter()
            with torch.no_grad():
                logits = forward_steps(group[0][1].model, [step for _, step in group])
            self.rounds.append((len(group), time.perf_counter() - began))
            for i, (key, _) in enumerate(group):
                self._done[key] = logits[i]
                del self._pending[key]
            computed += len(group)
            self.passes += 1
        self.batched_steps += computed
        return computed

    def alone(self, model: Any, cache: Any, token: int, position: int) -> torch.Tensor:
        """`step_alone`, its pass recorded as a round of one."""
        began = time.perf_counter()
        logits = step_alone(model, cache, token, position)
        self.rounds.append((1, time.perf_counter() - began))
        return logits

    def take_rounds(self) -> list[tuple[int, float]]:
        """The ``(steps, seconds)`` of the passes made since the last call."""
        rounds, self.rounds = self.rounds, []
        return rounds


@contextlib.contextmanager
def installed(batch: StepBatch) -> Iterator[StepBatch]:
    """Make ``batch`` the one this thread's decoding announces its steps to, while the block runs."""
    before = getattr(_local, "batch", None)
    _local.batch = batch
    try:
        yield batch
    finally:
        _local.batch = before


def current() -> StepBatch | None:
    """The `StepBatch` installed on this thread, if any."""
    return getattr(_local, "batch", None)


def batchable(model: Any, cache: Any) -> bool:
    """Whether a step of ``model`` over ``cache`` can run in `forward_steps` (checked once per model)."""
    known = getattr(model, "_kvrag_steps_batch", None)
    if known is None:
        layers = hf_compat.decoder_layers(model)
        family = family_of(model.config)
        known = (all(llama_layer.runs_plain(layer) for layer in layers)
                 and all(kind.window is None for kind in family.kinds)
                 and len({kind.rope for kind in family.kinds}) == 1)
        model._kvrag_steps_batch = known
    return bool(known) and appendable(cache)


def step_alone(model: Any, cache: Any, token: int, position: int) -> torch.Tensor:
    """The logits ``[vocab]`` (float32) of one step computed on its own (`forward_steps` where the step is
    `batchable`, so its rows go into the cache's room; else the model's own forward).
    """
    with torch.no_grad():
        if batchable(model, cache):
            return forward_steps(model, [_Step(model, cache, token, position)])[0]
        device = next(model.parameters()).device
        out = model(input_ids=torch.tensor([[token]], device=device),
                    position_ids=torch.tensor([[position]], device=device), **hf_compat.with_cache(model, cache),
                    use_cache=True)
        return out.logits[0, -1].float()


def forward_steps(model: Any, steps: list[_Step]) -> torch.Tensor:
    """The last-token logits ``[B, vocab]`` (float32) of one token per step, each over its own cache, which each
    step extends by its token's row as the model's own forward would (one step alone: in compiled layers where
    `kvrag.generation.layer_steps` takes it).
    """
    if len(steps) == 1:
        logits = layer_steps.one_token(model, steps[0].cache, steps[0].token, steps[0].position)
        if logits is not None:
            return logits
    family = family_of(model.config)
    device = next(model.parameters()).device
    ids = torch.tensor([[s.token] for s in steps], device=device)
    positions = torch.tensor([[s.position] for s in steps], device=device)
    hidden = family.embed(model, ids)  # [B, 1, hidden]
    rot = llama_layer.Rope(family.rope(model, family.kinds[0].rope, hidden, positions), hidden.dtype)
    for idx, layer in enumerate(hf_compat.decoder_layers(model)):
        hidden = hidden + _attention(layer, idx, llama_layer.rms_norm(layer.input_layernorm, hidden), rot, steps)
        hidden = hidden + llama_layer._mlp(layer.mlp, llama_layer.rms_norm(layer.post_attention_layernorm, hidden))
    return family.logits(model, hidden)[:, -1].float()


def _attention(layer: Any, idx: int, h: torch.Tensor, rot: llama_layer.Rope, steps: list[_Step]) -> torch.Tensor:
    """The attention block's output ``[B, 1, hidden]``: projections together, each step over its own cache."""
    attn = layer.self_attn
    d = attn.head_dim
    queries = rot.rotate(llama_layer.heads(attn.q_proj, getattr(attn, "q_norm", None), h, d))
    keys = rot.rotate(llama_layer.heads(attn.k_proj, getattr(attn, "k_norm", None), h, d))
    values = llama_layer.heads(attn.v_proj, None, h, d)
    outs = []
    for b, step in enumerate(steps):
        k, v = append_rows(step.cache.layers[idx], keys[b : b + 1], values[b : b + 1])
        outs.append(llama_layer.attend(queries[b : b + 1], k, v, None, attn.scaling))
    out = torch.cat(outs).transpose(1, 2).reshape(h.shape[0], 1, -1)
    return linear(out, attn.o_proj.weight, attn.o_proj.bias)
