"""kvrag.model.cpu_linear: the few-rows kernel equals ``F.linear`` to float rounding, each row's numbers do not depend
on the rows beside it, and everything it does not serve is ``F.linear`` itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from kvrag.model import cpu_linear
from kvrag.model.cpu_linear import FEW_ROWS, linear


def _weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def test_the_kernel_serves_this_platform() -> None:
    """numba's OpenMP layer is there wherever torch's wheel is (it brings libgomp): the kernel must be in use."""
    linear(torch.ones(1, 4), torch.ones(3, 4))
    assert isinstance(cpu_linear._kernel, ModuleType), "the few-rows kernel is not in use (numba's threading layer?)"


@pytest.mark.parametrize("rows", [1, 2, 5, FEW_ROWS])
@pytest.mark.parametrize("shape", [(576, 576), (1536, 576), (576, 1536), (49, 7)])
def test_few_rows_equal_f_linear_to_float_rounding(rows: int, shape: tuple[int, int]) -> None:
    weight, x = _weights(*shape), _weights(rows, shape[1], seed=1)
    got, want = linear(x, weight), F.linear(x, weight)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_each_row_is_the_same_alone_and_beside_others() -> None:
    weight, x = _weights(1536, 576), _weights(8, 576, seed=2)
    together = linear(x, weight)
    for r in range(8):
        assert torch.equal(linear(x[r : r + 1], weight)[0], together[r])


def test_batched_shapes_and_a_bias_keep_their_layout() -> None:
    weight, bias, x = _weights(64, 32), _weights(1, 64, seed=3)[0], _weights(6, 32, seed=4).view(2, 3, 32)
    got = linear(x, weight, bias)
    assert got.shape == (2, 3, 64)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    strided = _weights(4, 64, seed=5)[:, ::2]  # not contiguous
    torch.testing.assert_close(linear(strided, weight), F.linear(strided, weight), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("case", ["float64", "bfloat16", "a transposed weight", "gradients"])
def test_what_the_kernel_does_not_serve_is_f_linear_itself(case: str) -> None:
    weight, x = _weights(96, 48), _weights(3, 48, seed=6)
    if case in ("float64", "bfloat16"):
        dtype = torch.float64 if case == "float64" else torch.bfloat16
        weight, x = weight.to(dtype), x.to(dtype)
    elif case == "a transposed weight":
        weight = _weights(48, 96).t()
    else:
        weight.requires_grad_(True)
    got = linear(x, weight)
    assert torch.equal(got, F.linear(x, weight))
    if case == "gradients":
        got.sum().backward()
        assert weight.grad is not None


@pytest.mark.parametrize("rows", [FEW_ROWS + 1, 300])
def test_more_rows_go_to_onednn_equal_to_f_linear_to_float_rounding(rows: int) -> None:
    weight, bias, x = _weights(1536, 576), _weights(1, 1536, seed=9)[0], _weights(rows, 576, seed=10).view(1, rows, 576)
    got = linear(x, weight, bias)
    assert cpu_linear._onednn is True, "oneDNN's matmul is not in use (torch built without it?)"
    assert torch.equal(got[0], torch.ops.mkldnn._linear_pointwise(x[0], weight, bias, "none", [], ""))
    want = F.linear(x, weight, bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_the_switch_turns_both_kernels_off() -> None:
    code = ("import torch, torch.nn.functional as F; from kvrag.model import cpu_linear as c;"
            "w, x = torch.randn(300, 200), torch.randn(40, 200);"
            "assert torch.equal(c.linear(x[:3], w), F.linear(x[:3], w)) and c._kernel is False;"
            "assert torch.equal(c.linear(x, w), F.linear(x, w)) and c._onednn is False; print('off')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, cpu_linear.ENV_SWITCH: "0"})
    assert done.returncode == 0 and done.stdout.strip() == "off", done.stderr[-2000:]



def _child_product(weight: torch.Tensor, x: torch.Tensor, done) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)  # as torch asks of a forked child (its own OpenMP pool does not survive a fork)
    done.put(linear(x, weight).numpy().tobytes())


def test_a_process_forked_after_the_kernel_ran_gets_the_same_numbers() -> None:
    """numba's OpenMP layer ends a forked child that runs a parallel kernel: the child runs the loops on one thread,
    and a build in a forked worker must write the bytes its parent would."""
    import multiprocessing

    weight, x = _weights(300, 200), _weights(2, 200, seed=7)
    here = linear(x, weight)  # the kernel runs in this process first
    ctx = multiprocessing.get_context("fork")
    done = ctx.Queue()
    child = ctx.Process(target=_child_product, args=(weight, x, done))
    child.start()
    child.join(120)
    assert child.exitcode == 0 and done.get(timeout=5) == here.numpy().tobytes()
    assert isinstance(cpu_linear._kernel, ModuleType)  # still in use here


@pytest.mark.parametrize("rows", [1, 3, FEW_ROWS])
def test_one_thread_gives_the_threads_numbers_bit_for_bit(rows: int) -> None:
    from kvrag.model import few_rows_gemm

    for n, k in [(576, 576), (1536, 576), (576, 1536), (49, 7)]:
        weight, x = _weights(n, k).numpy(), _weights(rows, k, seed=8).numpy()
        threads, one = (torch.empty(rows, n).numpy() for _ in range(2))
        few_rows_gemm.multiply(x, weight, threads, 2)
        few_rows_gemm.multiply(x, weight, one, 0)
        assert (threads == one).all()
