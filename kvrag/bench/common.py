"""Helpers shared by the benchmarks: mode specs, hardware/version stamps, output files, plots.

A mode spec is ``full``, ``prefix``, ``reuse``, ``cacheblend@RATIO``, ``probe@RATIO`` or
``attnlink@K`` (leading tokens recomputed per chunk), and in the quality benchmark also ``full@DTYPE``
(full prefill with the model loaded in another dtype) and the modes `register_question_mode` adds (a
selection chosen per question, e.g. the deviation oracle of ``benchmarks/experiments``). Any mode but
``full`` may end in ``+adaptive``: the same mode planned by the loading controller (`FuseConfig.adaptive`).
`parse_modes` turns a comma list into labelled `FuseConfig`s. The benchmarks' options are in `kvrag.bench.options`,
which imports none of this, so that ``kvrag bench NAME --help`` answers without torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from kvrag.config import ATTENTION_KERNELS, FuseConfig
from kvrag.fusion.selectors.base import Selector, available_modes, selector_class
from kvrag.indexing.manifest import installed_versions


@dataclass(frozen=True)
class ModeSpec:
    """A benchmark mode: its label (as given on the command line) and its fusion settings."""

    label: str
    config: FuseConfig
    # a selection chosen per question outside the answer's timing: (rag, question item, config) -> Selector
    # (quality bench only; `register_question_mode`)
    selector_for: Callable[[Any, dict[str, Any], FuseConfig], Selector] | None = None
    dtype: str | None = None  # full prefill with the model loaded in this dtype instead (quality bench only)
    gate: bool = False  # answer under the correctness gate's default settings (``NAME+gate``, quality bench only)

    @property
    def reference(self) -> bool:
        """Whether this is the ``full`` every other mode is compared with."""
        return self.config.mode == "full" and self.dtype is None


PRECISIONS = ("bfloat16", "float16", "float32")
# modes of the quality benchmark beyond the registered selectors: name -> (label, @value text) -> ModeSpec
QUESTION_MODES: dict[str, Callable[[str, str], ModeSpec]] = {}


def register_question_mode(name: str, make: Callable[[str, str], ModeSpec]) -> None:
    """Let ``kvrag bench quality --modes`` take ``NAME@VALUE``: ``make(label, value)`` gives its `ModeSpec`, whose
    ``selector_for`` chooses each question's tokens (research selections such as an oracle, kept out of kvrag).
    """
    if name in available_modes():
        raise ValueError(f"{name!r} is a fusion mode already")
    QUESTION_MODES[name] = make


def parse_mode(text: str) -> ModeSpec:
    """``cacheblend@0.15`` -> ratio 0.15 (``cacheblend@0.15/kv`` also picks the token score: ``kv``,
    ``attention`` or ``kv_attention``); ``probe@0.2`` -> ratio 0.2 (``probe@0.2/0.75`` also sets
    ``probe_from``; ``probe@0.2/probe_to=0.5`` sets any option by name, ``/`` between options);
    ``attnlink@16`` -> 16 link tokens; ``full@bfloat16`` -> full prefill with the model in bfloat16 (how far
    precision alone moves the answer); bare names use defaults.
    ``+adaptive`` lets the loading controller plan; ``+gate`` answers under the correctness gate;
    ``+blocks`` (any of `ATTENTION_KERNELS`) sets `FuseConfig.attention`, so two kernels run side by side.
    """
    body, plus, extra = text.strip().partition("+")
    if plus and extra == "gate":
        base = parse_mode(body)
        if base.config.mode == "full" or base.selector_for or base.dtype:
            raise ValueError(f"+gate checks a fused cache; {body!r} fuses none")
        return dataclasses.replace(base, label=text.strip(), gate=True)
    if plus and extra in ATTENTION_KERNELS:
        base = parse_mode(body)
        return dataclasses.replace(base, label=text.strip(),
                                   config=dataclasses.replace(base.config, attention=extra))
    if plus:
        if extra != "adaptive":
            raise ValueError(f"a mode takes only '+adaptive', '+gate' or an attention kernel "
                             f"({', '.join(ATTENTION_KERNELS)}) after it, got {text!r}")
        base = parse_mode(body)
        if base.config.mode == "full" or base.selector_for:
            raise ValueError(f"+adaptive plans loading from the store; {body!r} loads nothing")
        return dataclasses.replace(base, label=text.strip(),
                                   config=dataclasses.replace(base.config, adaptive=True))
    spec, _, option = body.partition("/")
    name, _, arg = spec.partition("@")
    label = text.strip()
    if name in QUESTION_MODES and not option:
        return QUESTION_MODES[name](label, arg)
    if name == "full" and arg and not option:
        if arg not in PRECISIONS:
            raise ValueError(f"full@DTYPE takes one of {PRECISIONS}, got {text!r}")
        return ModeSpec(label, FuseConfig(mode="full"), dtype=arg)
    if name not in available_modes():
        raise ValueError(f"unknown mode {text!r}; expected one of {available_modes()} (optionally NAME@VALUE)")
    selector = selector_class(name)
    settings: dict[str, Any] = {}
    if arg:
        if selector.value_field is None:
            raise ValueError(f"mode {name!r} takes no @value, got {text!r}")
        settings[selector.value_field] = _field_value(selector, selector.value_field, arg)
    for part in option.split("/") if option else []:
        key, eq, value = part.partition("=")
        if not eq:
            if selector.option_field is None:
                raise ValueError(f"mode {name!r} takes no /option, got {text!r}")
            key, value = selector.option_field, part
        if key not in {f.name for f in dataclasses.fields(selector.Options)}:
            raise ValueError(f"mode {name!r} has no option {key!r}, got {text!r}")
        settings[key] = _field_value(selector, key, value)
    ratio = settings.pop("ratio", FuseConfig.ratio)
    config = FuseConfig(mode=name, ratio=ratio, options=settings)
    selector.options(config)  # a bad option value is refused here, before anything runs
    return ModeSpec(label, config)


def _field_value(selector: type[Selector], name: str, text: str) -> Any:
    """``text`` as the type of ``ratio`` or of the mode's option ``name`` (a spec's @value or /option)."""
    default = FuseConfig.ratio if name == "ratio" else getattr(selector.Options(), name)
    return type(default)(text) if isinstance(default, (int, float)) else text


def parse_modes(text: str, quality: bool = False) -> list[ModeSpec]:
    """Parse a comma list of mode specs; ``full`` is always included (first): every ratio needs it.
    ``full@DTYPE`` and the modes of `register_question_mode` are accepted only with ``quality`` (the quality
    benchmark, which runs them).
    """
    specs = [parse_mode(t) for t in text.split(",") if t.strip()]
    per_question = [s.label for s in specs if s.selector_for is not None]
    if not quality and per_question:
        raise ValueError(f"{per_question[0]} chooses its tokens per question; only `kvrag bench quality` runs it")
    if not quality and any(s.dtype for s in specs):
        raise ValueError("full@DTYPE compares answers across precisions; only `kvrag bench quality` runs it")
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--modes lists a mode twice: {text!r}")
    full = [s for s in specs if s.reference] or [ModeSpec("full", FuseConfig(mode="full"))]
    return full[:1] + [s for s in specs if not s.reference]


def with_fuse_settings(specs: list[ModeSpec], check_layers: str | None = None,
                       attention: str | None = None, first_ratio_scale: float | None = None) -> list[ModeSpec]:
    """The modes with what a command-line flag sets for all of them replaced: ``attention``, and the options of
    the modes that take them, ``check_layers`` (a comma list such as ``0,1,2``) and ``first_ratio_scale``; None
    leaves a setting as it is.
    """
    options: dict[str, Any] = {}
    if check_layers is not None:
        try:
            options["check_layers"] = tuple(int(t) for t in check_layers.split(",") if t.strip())
        except ValueError:
            raise ValueError(f"--check-layers must be a comma list of layer indices, got {check_layers!r}") from None
    if first_ratio_scale is not None:
        options["first_ratio_scale"] = first_ratio_scale
    for name, value in options.items():  # checked by a mode that takes the option, whether or not one runs
        owner = next(selector_class(m) for m in available_modes()
                     if name in {f.name for f in dataclasses.fields(selector_class(m).Options)})
        owner.Options(**{name: value})
    out = []
    for spec in specs:
        config = spec.config if attention is None else dataclasses.replace(spec.config, attention=attention)
        taken = {f.name for f in dataclasses.fields(selector_class(config.mode).Options)}
        config = config.with_options(**{k: v for k, v in options.items() if k in taken})
        out.append(dataclasses.replace(spec, config=config))
    return out


def parse_ints(text: str, name: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{name} must be a comma list of integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{name} must list positive integers, got {text!r}")
    return values


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware() -> dict[str, Any]:
    """CPU model, visible cores, torch threads, load average and the GPU (if any)."""
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "gpu": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["gpu"] = {"name": props.name, "memory_gb": round(props.total_memory / 2**30, 1)}
    return info


def versions() -> dict[str, str]:
    return {"python": sys.version.split()[0],
            **installed_versions(("kvrag", "torch", "transformers", "numpy", "matplotlib"))}


def stamp(args: Any = None) -> dict[str, Any]:
    """Describe the run for every result file: when, the command, parsed options, hardware, versions.

    ``command`` is the process's own command line (``kvrag …`` when run from the shell); ``options``
    holds the parsed arguments, which also identify the run when the CLI is called in-process.
    """
    options = {k: v for k, v in vars(args).items() if not callable(v)} if args is not None else {}
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "options": options,
        "hardware": hardware(),
        "versions": versions(),
    }


def _clean(value: Any) -> Any:
    """NaN/inf become null so the JSON is strict."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(payload), indent=2, allow_nan=False) + "\n")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "–" if not math.isfinite(v) else f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def pyplot() -> Any:
    """Matplotlib's pyplot on the Agg backend, or an actionable ImportError."""
    try:  # matplotlib is optional (the bench extra) and picks a process-wide backend: loaded only to draw
        import matplotlib
    except ImportError:
        raise ImportError("the benchmark plots need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the backend, as matplotlib requires

    return plt


def save_plot(plt: Any, fig: Any, ax: Any, path: Path, title: str, grid: str = "major") -> None:
    """Title, grid (``grid``: major/minor/both ticks) and legend in the benchmarks' common style; write
    ``path`` and free the figure.
    """
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which=grid)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cuda_sync(device: Any) -> None:
    """Wait for queued GPU work before reading a clock (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def set_threads(threads: int | None) -> None:
    """Pin torch's CPU thread count (fewer threads than cores is steadier on a shared machine)."""
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
