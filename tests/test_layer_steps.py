"""kvrag.generation.layer_steps: a step in compiled layers gives the torch path's logits and cache rows to float
rounding, runs only where its conditions hold, and follows the model's weights.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import tiny_model

from kvrag.generation import layer_steps
from kvrag.generation.step_batch import step_alone
from kvrag.model import hf_compat


def _prefilled(model, n: int = 37, seed: int = 0):
    ids = torch.randint(3, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = model(ids[None], use_cache=True, **hf_compat.with_cache(model, hf_compat.full_cache(model)))
    return hf_compat.returned_cache(out)


def _steps(model, kernel: bool, tokens=(5, 9, 2, 17, 11)):
    """Logits of a few steps after the same prompt, through the kernel or through torch."""
    model._kvrag_layer_steps = None if kernel else hf_compat.decoder_layers(model)[0].self_attn.q_proj.weight.data_ptr()
    cache, got = _prefilled(model), []
    for i, token in enumerate(tokens):
        got.append(step_alone(model, cache, token, 37 + i))
    return torch.stack(got), cache


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3"])
def test_compiled_layers_give_the_torch_steps_logits_and_rows(arch: str) -> None:
    """Llama, with llama3 rotary scaling, Qwen2's q/k/v biases and Qwen3's per-head query and key norms."""
    model = tiny_model(arch)
    fast, fast_cache = _steps(model, kernel=True)
    assert isinstance(model._kvrag_layer_steps, layer_steps._Plan), "the compiled layers did not take the steps"
    slow, slow_cache = _steps(model, kernel=False)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5 * float(slow.abs().max()))
    assert torch.equal(fast.argmax(-1), slow.argmax(-1))
    for a, b in zip(fast_cache.layers, slow_cache.layers):
        assert a.keys.shape == b.keys.shape and a.keys.shape[-2] == 42
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)


def test_a_sliding_window_stays_on_the_torch_path() -> None:
    model = tiny_model("mistral")
    cache = _prefilled(model)
    rows = cache.layers[0].keys.shape[-2]
    assert layer_steps.one_token(model, cache, 5, 37) is None
    assert not isinstance(model._kvrag_layer_steps, layer_steps._Plan)
    assert cache.layers[0].keys.shape[-2] == rows  # nothing touched


def test_a_cache_of_two_rows_of_batch_stays_on_the_torch_path() -> None:
    model = tiny_model("llama")
    cache = _prefilled(model)
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.repeat(2, 1, 1, 1), layer.values.repeat(2, 1, 1, 1)
    assert layer_steps.one_token(model, cache, 5, 37) is None


def test_the_plan_follows_the_weights() -> None:
    """A model moved to another dtype and back gets a fresh plan: the kernel never reads weights it no longer has."""
    model = tiny_model("llama")
    before, _ = _steps(model, kernel=True)
    model.to(torch.float64)
    assert layer_steps.one_token(model, _prefilled(model), 5, 37) is None
    model.to(torch.float32)
    cache, after = _prefilled(model), []
    for i, token in enumerate((5, 9, 2, 17, 11)):  # the plan is not reset: it follows the weights by itself
        after.append(step_alone(model, cache, token, 37 + i))
    assert isinstance(model._kvrag_layer_steps, layer_steps._Plan)
    torch.testing.assert_close(torch.stack(after), before, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_one_thread_gives_the_threads_numbers_bit_for_bit(arch: str) -> None:
    from kvrag.model import layer_step_kernel as kernel

    model = tiny_model(arch)
    _steps(model, kernel=True)
    weights = model._kvrag_layer_steps.weights[1]
    rng = np.random.default_rng(0)
    h = rng.standard_normal(64).astype(np.float32)
    cos, sin = np.cos(np.arange(16, dtype=np.float32)), np.sin(np.arange(16, dtype=np.float32))
    results = []
    for threads in (2, 0):
        state, queries = h.copy(), np.empty(64, np.float32)
        keys, values = np.zeros((2, 8, 16), np.float32), np.zeros((2, 8, 16), np.float32)
        kernel.before_attention(state, weights, cos, sin, keys, values, 3, 1e-5, 1e-6, queries, threads)
        kernel.after_attention(state, weights, queries.copy(), 1e-5, threads)
        results.append((state, queries, keys, values))
    for a, b in zip(*results):
        assert np.array_equal(a, b)


def test_the_switch_keeps_every_step_on_the_torch_path() -> None:
    code = ("import sys; sys.path.insert(0, 'tests'); from conftest import tiny_model;"
            "from test_layer_steps import _prefilled; from kvrag.generation import layer_steps;"
            "m = tiny_model('llama'); assert layer_steps.one_token(m, _prefilled(m), 5, 37) is None; print('off')")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root,
                          env={**os.environ, "KVRAG_CPU_KERNELS": "0"})
    assert done.returncode == 0 and done.stdout.strip().endswith("off"), done.stderr[-2000:]


def test_the_first_compilation_on_a_machine_is_announced_once_and_can_come_ahead(tmp_path) -> None:
    """An empty numba cache: `compile_ahead` compiles (and says so); the next process's first step finds the kernels
    compiled and says nothing, and has nothing to compile ahead."""
    head = ("import logging, sys; sys.path.insert(0, 'tests'); logging.basicConfig(level=logging.WARNING);"
            "from conftest import tiny_model; from test_layer_steps import _prefilled;"
            "from kvrag.generation import layer_steps; m = tiny_model('llama');")
    codes = [head + "assert layer_steps.compile_ahead(m)",
             head + "assert layer_steps.one_token(m, _prefilled(m), 5, 37) is not None;"
                    "assert not layer_steps.compile_ahead(m)"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    said = []
    for code in codes:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=root,
                              env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)})
        assert done.returncode == 0, done.stderr[-2000:]
        said.append("compiling kvrag's decoding kernels" in done.stderr)
    assert said == [True, False]
