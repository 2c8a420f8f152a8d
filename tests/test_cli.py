"""The `kvrag` command line on a tiny random model: results, one-line errors, quiet output, sizes, help."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
from test_documents import encrypted_pdf, minimal_pdf, write_docx

from kvrag.cli import build_parser, main
from kvrag.cli.sizes import PARTS, expected_cache_bytes

SMALL = ["--max-tokens", "32", "--min-tokens", "4"]


def _docs(tmp_path: Path) -> Path:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The alpha reactor was designed by Mira Okafor.\n\nIt runs on salt.")
    (docs / "b.md").write_text("Beta station orbits the moon. Its commander is Jonas Reyes.")
    return docs


@pytest.fixture(scope="module")
def built(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An index over two small documents, built once for the tests that only read it."""
    tmp = tmp_path_factory.mktemp("cli")
    idx = tmp / "idx"
    assert main(["index", str(_docs(tmp)), "--index", str(idx), "--model", str(tiny_model_dir), "-q", *SMALL]) == 0
    return idx


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvrag: error: "), err
    return lines[0]


def test_index_then_ask_json(built: Path, capsys):
    capsys.readouterr()
    assert main(["ask", str(built), "Who designed the reactor?", "--mode", "cacheblend", "--ratio", "0.15",
                 "--k", "2", "--max-new-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "cacheblend" and out["ratio"] == 0.15
    assert len(out["chunks"]) == 2 and out["ttft_s"] > 0 and isinstance(out["answer"], str)
    assert out["load_model_s"] > 0 and "warmup" not in out
    assert main(["ask", str(built), "Who designed the reactor?", "--k", "2", "--max-new-tokens", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)  # the default: probe under the gate, which recomputes a prompt
    assert out["gate"]["decision"] == "short" and out["mode"] == "prefix"  # this short after its first chunk
    assert main(["info", str(built), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["chunks"] >= 2


def test_ask_prints_the_answer_then_one_timing_line(built: Path, capsys):
    capsys.readouterr()
    assert main(["ask", str(built), "Who designed the reactor?", "--k", "1", "--max-new-tokens", "2"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1
    (line,) = err.strip().splitlines()
    assert line.startswith("[prefix; gate: short prompt") and "first answer, includes warm-up" in line
    assert "model load" in line and "not in the TTFT" in line
    assert main(["ask", str(built), "Who designed the reactor?", "--k", "1", "--max-new-tokens", "2", "--stream",
                 "--warmup", "1"]) == 0
    assert "after 1 warm-up answer)" in capsys.readouterr().err


def test_ask_warmup_is_reported_in_json(built: Path, capsys):
    capsys.readouterr()
    assert main(["ask", str(built), "Who designed the reactor?", "--k", "1", "--max-new-tokens", "2", "--json",
                 "--warmup", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["warmup"] == 2 and out["warmup_s"] > 0 and out["load_model_s"] > 0


def test_errors_are_reported_not_raised(tmp_path: Path, capsys):
    assert main(["ask", str(tmp_path / "missing"), "q?"]) == 2
    assert "no kvrag index" in _one_error_line(capsys.readouterr().err)
    (tmp_path / "not-an-index").mkdir()
    assert main(["info", str(tmp_path / "not-an-index")]) == 2
    assert "no kvrag index" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("argv, expected", [
    (["ask", "IDX", "   "], "the question is empty"),
    (["ask", "IDX", "q?", "--k", "0"], "argument --k: must be a positive integer, got '0'"),
    (["ask", "IDX", "q?", "--k", "two"], "argument --k: must be an integer, got 'two'"),
    (["ask", "IDX", "q?", "--ratio", "1.5"], "argument --ratio: must be in (0, 1], got '1.5'"),
    (["ask", "IDX", "q?", "--mode", "fast"], "argument --mode: invalid choice: 'fast'"),
    (["ask", "IDX"], "the following arguments are required: QUESTION"),
    (["index", "nowhere/", "--index", "X"], "document path does not exist: nowhere"),
    (["index", "DOCS", "--index", "X", "--codec", "zip"], "unknown codec 'zip'"),
    (["index", "DOCS", "--index", "IDX", "--codec", "int8"], "uses codec 'cachegen', not 'int8'"),
    (["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate'"),
])
def test_bad_input_is_one_line(built: Path, tmp_path: Path, capsys, argv, expected):
    argv = [str(built) if a == "IDX" else str(tmp_path / "x") if a == "X" else a for a in argv]
    argv = [str(_docs(tmp_path)) if a == "DOCS" else a for a in argv]
    assert main(argv) == 2
    assert expected in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("model, expected", [
    ("smolm2", "Did you mean 'smollm2'?"),
    ("gpt2", "not in the local Hugging Face cache"),
    ("./no/such/folder", "there is no folder ./no/such/folder"),
])
def test_unknown_model_is_one_line_naming_what_was_tried(tmp_path: Path, capsys, model, expected):
    docs = _docs(tmp_path)
    assert main(["index", str(docs), "--index", str(tmp_path / "idx"), "--model", model]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"model {model!r} not found" in line and expected in line
    assert "hub id" in line and "local folder" in line and ".gguf file" in line
    assert not (tmp_path / "idx").exists()


def test_debug_shows_the_traceback(tmp_path: Path, capsys):
    assert main(["--debug", "index", str(_docs(tmp_path)), "--index", str(tmp_path / "i"), "--model", "smolm2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.strip().splitlines()[-1].startswith("kvrag: error: ")


def test_unexpected_failures_are_one_line_too(built: Path, capsys, monkeypatch):
    import kvrag.cli.info

    def boom(path: Path) -> None:
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(kvrag.cli.info, "describe", boom)
    assert main(["info", str(built)]) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert line == "kvrag: error: unexpected RuntimeError: boom second line (run again with --debug for the traceback)"
    assert main(["info", str(built), "--debug"]) == 1  # the global flags work after the command too
    assert "Traceback" in capsys.readouterr().err


def test_ask_refuses_an_index_built_with_another_model(built: Path, other_model_dir: Path, capsys):
    capsys.readouterr()
    assert main(["ask", str(built), "Who designed the reactor?", "--model", str(other_model_dir)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "was built with model" in line and "fingerprint" in line


def test_index_prints_the_expected_size_first_and_the_written_size_last(tiny_model_dir: Path, tmp_path: Path,
                                                                         capsys, monkeypatch):
    import kvrag.cli.index

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(kvrag.cli.index.shutil, "disk_usage", lambda path: usage(100, 90, 10))
    docs = tmp_path / "docs.txt"
    docs.write_text("Gamma labs moved to Lisbon in 2011. " * 6 + "\n\nDelta works on tides. " * 6)
    idx = tmp_path / "idx"
    # raw: its size is known exactly (a lossy codec's is estimated from bits per element measured on SmolLM2)
    assert main(["index", str(docs), "--index", str(idx), "--model", str(tiny_model_dir), "-q", "--codec", "raw",
                 *SMALL]) == 0
    out, err = capsys.readouterr()
    first, last = out.strip().splitlines()
    assert first.startswith(f"{idx}: 1 document, ") and " tokens: about " in first and "of caches (raw" in first
    assert last.startswith(f"{idx}: ") and " chunks; wrote " in last and "on disk in all" in last
    assert err.startswith("kvrag: warning: the caches need about ") and "has only 10 B free" in err

    assert main(["info", str(idx), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    expected = expected_cache_bytes(info["tokens"], info["model_spec"], "raw", 0)
    assert expected is not None and 0.8 < info["bytes"]["caches"] / expected < 1.25


def test_index_is_quiet_by_default_and_shows_a_bar_with_progress(tiny_model_dir: Path, tmp_path: Path, capsys):
    docs = _docs(tmp_path)
    assert main(["index", str(docs), "--index", str(tmp_path / "a"), "--model", str(tiny_model_dir), *SMALL]) == 0
    assert capsys.readouterr().err == ""  # stderr is not a terminal here: no bar, and no library noise
    assert main(["index", str(docs), "--index", str(tmp_path / "b"), "--model", str(tiny_model_dir), "--progress",
                 "-v", *SMALL]) == 0
    err = capsys.readouterr().err
    assert "computing caches" in err and "tok" in err  # one bar, in tokens
    assert "INFO kvrag." in err  # -v: kvrag's INFO logs


def test_cli_subprocess_prints_no_library_noise(tiny_model_dir: Path, tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "PYTHONWARNINGS"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    run = [sys.executable, "-c", "import sys; from kvrag.cli import main; sys.exit(main())"]
    idx = str(tmp_path / "idx")
    built = subprocess.run([*run, "index", str(_docs(tmp_path)), "--index", idx, "--model", str(tiny_model_dir),
                            *SMALL], capture_output=True, text=True, env=env, timeout=300)
    assert built.returncode == 0 and built.stderr == "", built.stderr
    asked = subprocess.run([*run, "ask", idx, "Who designed the reactor?", "--k", "1", "--max-new-tokens", "2"],
                           capture_output=True, text=True, env=env, timeout=300)
    assert asked.returncode == 0, asked.stderr
    assert len(asked.stderr.strip().splitlines()) == 1 and asked.stderr.startswith("[prefix; gate: short prompt")


def test_info_splits_the_bytes_on_disk(built: Path, capsys):
    capsys.readouterr()
    assert main(["info", str(built)]) == 0
    text = capsys.readouterr().out
    for word in ("created", "model", "codec      cachegen level 2", "chunks", "tokens", "caches", "FAISS",
                 "codec state", "text", "other", "per token"):
        assert word in text, word
    assert main(["info", str(built), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    sizes = info["bytes"]
    assert sum(sizes[p] for p in PARTS) == sizes["total"] > 0
    assert sizes["caches"] > 0 and sizes["faiss"] > 0 and sizes["text"] > 0
    assert info["cache_bytes_per_token"] == pytest.approx(sizes["caches"] / info["tokens"])
    assert info["codec"] == {"name": "cachegen", "level": 2} and info["created"] and info["model"]
    assert info["manifest"]["codec"]["name"] == "cachegen" and sizes["codec_state"] > 0
    spec, smaller = info["model_spec"], info["times_smaller_than_bf16"]
    bf16 = info["tokens"] * 2 * spec["n_layers"] * spec["n_kv_heads"] * spec["head_dim"] * 2
    assert info["bf16_kv_bytes"] == bf16 and smaller["caches"] == pytest.approx(bf16 / sizes["caches"])
    assert smaller["index"] == pytest.approx(bf16 / sizes["total"]) and smaller["caches"] > smaller["index"] > 0
    assert f"{smaller['caches']:.1f}x smaller than bf16 K/V" in text


def test_index_reads_pdf_docx_html_and_names_what_it_skipped(tiny_model_dir: Path, tmp_path: Path, capsys):
    from kvrag.storage.chunk_index import ChunkIndex

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.pdf").write_bytes(minimal_pdf("The alpha reactor runs on salt."))
    write_docx(docs / "b.docx", ["Beta station orbits the moon."])
    (docs / "c.html").write_text("<html><script>x()</script><p>Gamma labs moved to Lisbon.</p></html>")
    (docs / "d.bin").write_bytes(b"\x00\x01")
    (docs / "e.pdf").write_bytes(encrypted_pdf("secret"))
    idx = tmp_path / "idx"
    assert main(["index", str(docs), "--index", str(idx), "--model", str(tiny_model_dir), "--lazy", *SMALL]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"skipped 2 files: {docs / 'd.bin'} (not text), {docs / 'e.pdf'} (encrypted)"
    with ChunkIndex.open(idx) as index:
        text = " ".join(r.text for r in index.records())
    assert all(s in text for s in ("alpha reactor", "Beta station", "Gamma labs")) and "x()" not in text

    (tmp_path / "only.bin").write_bytes(b"\x00")
    assert main(["index", str(tmp_path / "only.bin"), "--index", str(idx)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.endswith(f"(skipped 1 file: {tmp_path / 'only.bin'} (not text))")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_option_has_help():
    parser = build_parser()
    commands = _subparsers(parser)
    for name, sub in [("kvrag", parser)] + [(c, commands[c]) for c in ("index", "ask", "info")]:
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help and action.help != argparse.SUPPRESS and action.help.strip(), \
                f"{name} {'/'.join(action.option_strings) or action.dest} has no help"
    assert "--warmup" in commands["ask"].format_help() and "TTFT" in commands["ask"].format_help()


def test_index_with_a_compressed_codec_and_level(tiny_model_dir: Path, tmp_path: Path, capsys):
    docs = tmp_path / "docs.txt"
    docs.write_text("Gamma labs moved to Lisbon in 2011. " * 6 + "\n\nDelta works on tides. " * 6)
    idx = tmp_path / "idx"
    assert main(["index", str(docs), "--index", str(idx), "--model", str(tiny_model_dir), "-q", "--codec", "cachegen",
                 "--codec-level", "2", *SMALL]) == 0
    assert "(cachegen level 2, float32 model" in capsys.readouterr().out
    assert main(["info", str(idx), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["manifest"]["codec"]["name"] == "cachegen" and info["manifest"]["codec"]["level"] == 2
    assert main(["ask", str(idx), "Where did Gamma labs move?", "--k", "2", "--max-new-tokens", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ttft_s"] > 0
    (tmp_path / "more.txt").write_text("Epsilon builds kites in Oslo.")
    assert main(["index", str(tmp_path / "more.txt"), "--index", str(idx), "-q"]) == 0  # keeps its codec
    assert "(1 new)" in capsys.readouterr().out


def test_index_with_neighbour_context(tiny_model_dir: Path, tmp_path: Path, capsys):
    docs = tmp_path / "docs.txt"
    docs.write_text("Gamma labs moved to Lisbon in 2011. " * 6 + "\n\nDelta works on tides. " * 6)
    idx = tmp_path / "idx"
    assert main(["index", str(docs), "--index", str(idx), "--model", str(tiny_model_dir), "-q",
                 "--neighbour-context", "1", *SMALL]) == 0
    capsys.readouterr()
    assert main(["info", str(idx), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["manifest"]["neighbour_context"] == 1
    assert main(["index", str(docs), "--index", str(idx), "-q", "--neighbour-context", "2"]) == 2
    assert "neighbour_context=1" in _one_error_line(capsys.readouterr().err)


def test_index_lazy_indexes_without_caches(tiny_model_dir: Path, tmp_path: Path, capsys):
    from kvrag import KVRag

    docs = tmp_path / "docs.txt"
    docs.write_text("Gamma labs moved to Lisbon in 2011. " * 6 + "\n\nDelta works on tides. " * 6)
    idx = tmp_path / "idx"
    assert main(["index", str(docs), "--index", str(idx), "--model", str(tiny_model_dir), "-q", "--lazy",
                 "--codec", "raw", *SMALL]) == 0  # (a codec that needs fitting caches a sample)
    assert "caches computed on first use" in capsys.readouterr().out
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


def test_ask_names_every_gate_decision_without_calling_it_a_failed_check():
    from kvrag.cli.ask import _gate_text
    from kvrag.query.gate import GateReport

    attempt = {"mode": "full", "ratio": 0.15, "signals": {}, "passed": True, "reason": "", "seconds": 0.1}
    for decision in ("exact", "kept", "stored", "text", "text_before", "fused"):
        assert "check failed" not in _gate_text(GateReport(decision, 600, [attempt]))
    assert "prefilled in full" in _gate_text(GateReport("exact", 600, [attempt]))
    failed = {**attempt, "mode": "probe", "passed": False, "reason": "first-token margin 0.1 < 1"}
    assert _gate_text(GateReport("escalated", 600, [failed, attempt])).startswith("check failed (first-token")
