"""How much the ``kvrag`` command says: logging levels, Python warnings and the libraries' own output.

Contract: `configured(verbosity)` is a context manager that sets, for its duration only
(everything is restored on exit, so `kvrag.cli.main` can run inside another program or a test):

======================  =====================  =============================  ========================
verbosity               kvrag's logs           libraries' logs and warnings   libraries' progress bars
======================  =====================  =============================  ========================
0 (default)             WARNING and up         errors only, warnings hidden   off
1 (``-v``)              INFO and up            WARNING and up, warnings shown off
2 (``-vv``)             DEBUG and up           INFO and up, warnings shown    on
======================  =====================  =============================  ========================

The libraries are transformers, sentence-transformers, huggingface_hub, tokenizers and pypdf (and
the warnings of torch and whatever else they call): through their logger levels, their environment
variables (read when they are imported) and, when already imported, their verbosity APIs; nothing is
imported to silence it. At verbosity 0, kvrag's records print
as ``kvrag: warning: …``; above, with level and logger name. The library itself never does any of
this: it only logs.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

LIBRARY_LOGGERS = ("transformers", "sentence_transformers", "huggingface_hub", "tokenizers", "pypdf", "filelock",
                   "urllib3", "httpx", "accelerate", "torch", "numba", "faiss", "nltk", "py.warnings")
# kvrag loggers whose warnings the CLI reports itself (`kvrag index` ends with the skipped files)
_REPORTED_BY_THE_CLI = ("kvrag.indexing.documents",)


def _kvrag_level(verbosity: int) -> int:
    return (logging.WARNING, logging.INFO)[verbosity] if verbosity < 2 else logging.DEBUG


def _library_level(verbosity: int) -> int:
    return (logging.ERROR, logging.WARNING)[verbosity] if verbosity < 2 else logging.INFO


class _Formatter(logging.Formatter):
    def __init__(self, verbosity: int) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")
        self.verbosity = verbosity

    def format(self, record: logging.LogRecord) -> str:
        if self.verbosity == 0 and record.name.split(".")[0] == "kvrag":
            return f"kvrag: {record.levelname.lower()}: {record.getMessage()}"
        return super().format(record)


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def _logger_levels(levels: dict[str, int]) -> Iterator[None]:
    saved = {name: logging.getLogger(name).level for name in levels}
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


@contextmanager
def _handler(verbosity: int) -> Iterator[None]:
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(verbosity))
    saved_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbosity >= 2 else logging.INFO if verbosity == 1 else logging.WARNING)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(saved_level)


@contextmanager
def _library_switches(verbosity: int) -> Iterator[None]:
    """Set transformers' and huggingface_hub's verbosity and progress bars for the block, restored after.

    A library imported before the block is switched through its API; one imported inside it reads the
    environment variables `configured` sets, and is put back to its defaults after the block.
    """
    tf_name, hub_name = "transformers.utils.logging", "huggingface_hub.utils"
    tf_before, hub_before = sys.modules.get(tf_name), sys.modules.get(hub_name)
    bars = verbosity >= 2
    saved: dict[str, Any] = {}
    if tf_before is not None:
        saved["tf"] = tf_before.get_verbosity(), tf_before.is_progress_bar_enabled()
        tf_before.set_verbosity(_library_level(verbosity))
        (tf_before.enable_progress_bar if bars else tf_before.disable_progress_bar)()
    if hub_before is not None:
        saved["hub"] = hub_before.are_progress_bars_disabled()
        (hub_before.enable_progress_bars if bars else hub_before.disable_progress_bars)()
    try:
        yield
    finally:
        tf, hub = sys.modules.get(tf_name), sys.modules.get(hub_name)
        tf_verbosity, tf_bars = saved.get("tf", (logging.WARNING, True))
        hub_off = saved.get("hub", False)
        if tf is not None:
            tf.set_verbosity(tf_verbosity)
            (tf.enable_progress_bar if tf_bars else tf.disable_progress_bar)()
        if hub is not None:
            (hub.disable_progress_bars if hub_off else hub.enable_progress_bars)()


@contextmanager
def configured(verbosity: int) -> Iterator[None]:
    """Set kvrag's and the libraries' verbosity (see the module docstring) for the ``with`` block."""
    verbosity = max(0, min(int(verbosity), 2))
    level_name = logging.getLevelName(_library_level(verbosity)).lower()
    env = {"TRANSFORMERS_VERBOSITY": level_name, "HF_HUB_VERBOSITY": level_name,
           "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "false")}
    if verbosity < 2:
        env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        env["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    levels = {name: _library_level(verbosity) for name in LIBRARY_LOGGERS}
    levels["kvrag"] = _kvrag_level(verbosity)
    if verbosity == 0:
        levels.update({name: logging.ERROR for name in _REPORTED_BY_THE_CLI})
    with ExitStack() as stack:
        stack.enter_context(_environment(env))
        stack.enter_context(warnings.catch_warnings())
        if verbosity == 0:
            warnings.simplefilter("ignore")
            warnings.filterwarnings("default", module=r"kvrag(\.|$)")
        else:
            warnings.simplefilter("default")
        stack.enter_context(_logger_levels(levels))
        stack.enter_context(_handler(verbosity))
        stack.enter_context(_library_switches(verbosity))
        yield
