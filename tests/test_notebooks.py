"""The demo notebooks are stored executed (outputs and a plot included) and run top to bottom from the
repository (offline, real SmolLM2, data from examples/data)."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ["01_quickstart.ipynb", "02_langchain.ipynb", "03_llamaindex.ipynb", "04_any_retriever.ipynb"]


def outputs(book) -> list:
    return [o for c in book.cells if c.cell_type == "code" for o in c.outputs]


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_stored_executed(name: str):
    book = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(book)
    code = [c for c in book.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), f"{name}: not run top to bottom"
    assert any("text" in o or "data" in o for o in outputs(book)), f"{name} has no outputs"
    assert not [o for o in outputs(book) if o.output_type == "error"], f"{name} was stored with an error"


def test_quickstart_shows_a_plot():
    book = nbformat.read(NOTEBOOKS / "01_quickstart.ipynb", as_version=4)
    assert any("image/png" in o.get("data", {}) for o in outputs(book))


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name: str, monkeypatch: pytest.MonkeyPatch):
    if name != "01_quickstart.ipynb":
        pytest.importorskip("langchain_core" if "langchain" in name else "llama_index.core")
    if name == "04_any_retriever.ipynb":
        pytest.importorskip("langchain_community")
    # the kernel inherits these: offline, and one thread (a 135M model on a busy 2-core CPU is faster so)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    book = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(book, timeout=240, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    assert not [o for o in outputs(book) if o.output_type == "error"]
    if name == "01_quickstart.ipynb":
        assert any("image/png" in o.get("data", {}) for o in outputs(book))
