"""The `kvrag` command line on a tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

from kvrag.cli import main


def test_index_then_ask_json(tiny_model_dir: Path, tmp_path: Path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The alpha reactor was designed by Mira Okafor.\n\nIt runs on salt.")
    (docs / "b.md").write_text("Beta station orbits the moon. Its commander is Jonas Reyes.")
    idx = tmp_path / "idx"
    assert main(["index", str(docs), "--index", str(idx), "--model", str(tiny_model_dir), "-q",
                 "--max-tokens", "32", "--min-tokens", "4"]) == 0
    capsys.readouterr()
    assert main(["ask", str(idx), "Who designed the reactor?", "--mode", "cacheblend", "--ratio", "0.15",
                 "--k", "2", "--max-new-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "cacheblend" and out["ratio"] == 0.15
    assert len(out["chunks"]) == 2 and out["ttft_s"] > 0 and isinstance(out["answer"], str)
    assert main(["ask", str(idx), "Who designed the reactor?", "--k", "2", "--max-new-tokens", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mode"] == "probe"  # the default mode
    assert main(["info", str(idx)]) == 0
    assert json.loads(capsys.readouterr().out)["chunks"] >= 2


def test_errors_are_reported_not_raised(tmp_path: Path, capsys):
    assert main(["ask", str(tmp_path / "missing"), "q?"]) == 2
    assert "no kvrag index" in capsys.readouterr().err


def test_index_with_a_compressed_codec_and_level(tiny_model_dir: Path, tmp_path: Path, capsys):
    docs = tmp_path / "docs.txt"
    docs.write_text("Gamma labs moved to Lisbon in 2011. " * 6 + "\n\nDelta works on tides. " * 6)
    idx = tmp_path / "idx"
    assert main(["index", str(docs), "--index", str(idx), "--model", str(tiny_model_dir), "-q", "--codec", "cachegen",
                 "--codec-level", "2", "--max-tokens", "32", "--min-tokens", "4"]) == 0
    capsys.readouterr()
    assert main(["info", str(idx)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["manifest"]["codec"]["name"] == "cachegen" and info["manifest"]["codec"]["level"] == 2
    assert main(["ask", str(idx), "Where did Gamma labs move?", "--k", "2", "--max-new-tokens", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ttft_s"] > 0


def test_index_with_neighbour_context(tiny_model_dir: Path, tmp_path: Path, capsys):
    docs = tmp_path / "docs.txt"
    docs.write_text("Gamma labs moved to Lisbon in 2011. " * 6 + "\n\nDelta works on tides. " * 6)
    idx = tmp_path / "idx"
    assert main(["index", str(docs), "--index", str(idx), "--model", str(tiny_model_dir), "-q",
                 "--neighbour-context", "1", "--max-tokens", "32", "--min-tokens", "4"]) == 0
    capsys.readouterr()
    assert main(["info", str(idx)]) == 0
    assert json.loads(capsys.readouterr().out)["manifest"]["neighbour_context"] == 1
    assert main(["index", str(docs), "--index", str(idx), "-q", "--neighbour-context", "2"]) == 2
    assert "neighbour_context=1" in capsys.readouterr().err


def test_index_lazy_indexes_without_caches(tiny_model_dir: Path, tmp_path: Path, capsys):
    from kvrag import KVRag

    docs = tmp_path / "docs.txt"
    docs.write_text("Gamma labs moved to Lisbon in 2011. " * 6 + "\n\nDelta works on tides. " * 6)
    idx = tmp_path / "idx"
    assert main(["index", str(docs), "--index", str(idx), "--model", str(tiny_model_dir), "-q", "--lazy",
                 "--max-tokens", "32", "--min-tokens", "4"]) == 0
    with KVRag.open(idx) as rag:
        keys = [r.key for r in rag.index.records()]
        assert len(keys) >= 2 and not any(rag.kvstore.contains(k) for k in keys)
    assert main(["index", str(docs), "--index", str(idx), "-q"]) == 0  # without --lazy: the missing caches
    with KVRag.open(idx) as rag:
        assert all(rag.kvstore.is_valid(k) for k in keys)


def test_index_with_its_own_instruction_and_question_tail(tiny_model_dir: Path, tmp_path: Path):
    docs = tmp_path / "docs.txt"
    docs.write_text("Gamma labs moved to Lisbon in 2011.")
    idx = tmp_path / "idx"
    assert main(["index", str(docs), "--index", str(idx), "--model", str(tiny_model_dir), "-q", "--lazy",
                 "--instruction", "Use the passages.", "--question-tail", ""]) == 0
    prompt = json.loads((idx / "manifest.json").read_text())["prompt"]
    assert prompt["instruction"] == "Use the passages." and prompt["question_tail"] == ""
