"""The demo notebooks run top to bottom (offline, real SmolLM2) and are stored without outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ["01_quickstart.ipynb", "02_langchain.ipynb", "03_llamaindex.ipynb"]


def test_notebooks_are_stored_without_outputs():
    for name in NAMES:
        book = nbformat.read(NOTEBOOKS / name, as_version=4)
        for cell in book.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{name} has outputs"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name: str, monkeypatch: pytest.MonkeyPatch):
    if name != "01_quickstart.ipynb":
        pytest.importorskip("langchain_core" if "langchain" in name else "llama_index.core")
    # the kernel inherits these: offline, and one thread (a 135M model on a shared CPU is faster so)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    book = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(book, timeout=240, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
