"""`linear`: ``F.linear`` for kvrag's model passes, through `kvrag.model.few_rows_gemm` or oneDNN where they are faster.

Contract: `linear(x, weight, bias)` returns ``F.linear(x, weight, bias)`` up to float rounding (the same sum in
another order, a relative difference of about 1e-6). A decoding step multiplies one row (or one per answer of a
batched step) by every weight matrix; torch runs a single row on one core, at about half the memory's speed on a
2-core machine, and a few rows slower still. Where it pays and is safe, at most `FEW_ROWS` rows of float32 on the
CPU, without gradients, with numba's OpenMP threading layer (``omp``, which shares torch's OpenMP runtime: with the
``workqueue`` layer a decoding step took 64 ms against torch's 60, and ``tbb`` was not measured), the product runs
in the numba kernel on ``torch.get_num_threads()`` threads. More rows of float32 on the CPU (a prefill, a recompute)
go to oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``, the op torch's own compiler emits for a CPU linear),
which ran SmolLM2's projections 1.0-1.06x as fast as ``F.linear`` (MKL) at 12-32 rows, 1.13x at 64, 1.31x at 512 and
(one 1536x576 projection) 1.7x at 2,048, and a 2,048-token prefill in 4.2-4.4 s against 5.2-5.3 s; a torch without
it, or one whose product differs from ``F.linear`` beyond float rounding, calls ``F.linear``, as GPUs and other
dtypes do. Each row's result depends only on that row and the weight, so a batched step's projections give each
answer the numbers its step alone gets (its norms and attention are torch's, not held to that). A process forked
after the kernel ran runs the same loops on one thread (numba's OpenMP layer ends a child that launches a parallel
kernel), with the same numbers: a build in a forked worker writes the bytes its parent would. Set
``KVRAG_CPU_KERNELS=0`` (or ``false``, ``no``, ``off``) to call ``F.linear`` always (neither kernel).

Measured on a 2-core AMD EPYC (AVX-512) with SmolLM2-135M's 211 weight matrices per token (537 MB of float32), in
one run: 1 row 48 ms with ``F.linear``, 23 ms here; 4 rows 73 and 28 ms; 8 rows 63 and 47 ms; 12 rows 66 and 65 ms;
16 rows 76 and 78 ms (an earlier run: 86 and 67 ms); 32 rows 102 and 125 ms.
"""

from __future__ import annotations

import importlib
import os
import threading
from types import ModuleType

import torch
import torch.nn.functional as F

from kvrag.config import switched_off
from kvrag.model import numba_start

ENV_SWITCH = "KVRAG_CPU_KERNELS"
FEW_ROWS = 8  # level with F.linear at about 12 rows; beyond, a blocked GEMM (oneDNN's) wins
KERNEL_MODULE = "kvrag.model.few_rows_gemm"  # imports numba (half a second of a cold process): loaded on first use
_MEASURED_LAYERS = frozenset({"omp"})

_kernel: ModuleType | bool | None = None  # the kernel's module once it serves this process, False where it cannot
_threads_off = False  # set in a process forked after the kernel ran: one thread, no parallel region
_onednn: bool | None = None  # whether oneDNN's matmul serves the longer products
_loading = threading.Lock()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[..., k]`` times ``weight`` ``[n, k]`` transposed, plus ``bias`` ``[n]``: ``[..., n]`` (see the
    module docstring for which rows take the kernel).
    """
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not (rows > 0 and _fits(x, weight)):
        return F.linear(x, weight, bias)
    flat = x.detach().reshape(rows, k).contiguous()
    if rows > FEW_ROWS:
        if not (_onednn if _onednn is not None else _probe_onednn()):
            return F.linear(x, weight, bias)
        out = torch.ops.mkldnn._linear_pointwise(flat, weight.detach(), bias, "none", [], "")
    else:
        threads = kernel_threads()
        if threads is None:
            return F.linear(x, weight, bias)
        out = torch.empty(rows, weight.shape[0], dtype=torch.float32)
        assert isinstance(_kernel, ModuleType)
        _kernel.multiply(flat.numpy(), weight.detach().numpy(), out.numpy(), threads)
        if bias is not None:
            out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


def kernel_threads() -> int | None:
    """The threads kvrag's numba kernels run on in this process (0: one, without a parallel region, in a process
    forked after one ran), or None where they do not serve it (switched off, another threading layer).
    """
    kernel = _kernel if _kernel is not None else _load_kernel()
    if not isinstance(kernel, ModuleType):
        return None
    return 0 if _threads_off else torch.get_num_threads()


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Float32 on the CPU, a plain 2-D weight, and no gradient to track."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and weight.device.type == "cpu" and weight.dim() == 2 and weight.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def _load_kernel() -> ModuleType | bool:
    """The kernel's module, or False where it does not serve this process (switched off, or numba's threading
    layer not one that was measured). Decided once, by one product of a single number.
    """
    global _kernel
    with _loading:
        if _kernel is None:
            _kernel = False
            if not switched_off(ENV_SWITCH):
                module = importlib.import_module(KERNEL_MODULE)
                one = torch.ones(1, 1).numpy()
                with numba_start.without_blas():  # where numba's target starts, in a cold `kvrag ask`
                    module.multiply(one, one, one.copy(), 1)
                if module.threading_layer() in _MEASURED_LAYERS:
                    _kernel = module
                    os.register_at_fork(after_in_child=_one_thread_in_a_forked_child)
    return _kernel


def _probe_onednn() -> bool:
    """Whether oneDNN's matmul serves this process: not switched off, present in this torch, and equal to
    ``F.linear`` to float rounding on one product (decided once).
    """
    global _onednn
    with _loading:
        if _onednn is None:
            _onednn = False
            if not switched_off(ENV_SWITCH) and torch.backends.mkldnn.is_available():
                x, weight = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) for shape in
                             ((FEW_ROWS + 1, 24), (40, 24)))
                try:
                    got = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
                except (AttributeError, RuntimeError, NotImplementedError):
                    return False
                _onednn = bool(torch.allclose(got, F.linear(x, weight), rtol=1e-5, atol=1e-5))
    return _onednn


def _one_thread_in_a_forked_child() -> None:
    global _threads_off
    _threads_off = True
