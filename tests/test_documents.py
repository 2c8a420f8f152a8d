"""kvrag.indexing.documents: the file types users have (text, JSON, HTML, PDF, DOCX) and what is skipped."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest

from kvrag.indexing.documents import Loaded, html_text, load_documents, skipped_summary


def minimal_pdf(*pages: str) -> bytes:
    """A valid PDF with one line of Helvetica text on each page (written by hand, offsets computed)."""
    n = len(pages)
    kids = " ".join(f"{3 + 2 * i} 0 R" for i in range(n))
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", f"<< /Type /Pages /Kids [{kids}] /Count {n} >>".encode()]
    font = 3 + 2 * n
    for i, text in enumerate(pages):
        content = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode("latin-1")
        objects.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 {font} "
                       f"0 R >> >> /Contents {4 + 2 * i} 0 R >>".encode())
        objects.append(b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream")
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % off for off in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def encrypted_pdf(text: str, password: str = "secret") -> bytes:
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(minimal_pdf(text))))
    writer.encrypt(password)
    buf = io.BytesIO()
    writer.write(buf)
    return buf.getvalue()


def write_docx(path: Path, paragraphs: list[str], table: list[list[str]] | None = None) -> Path:
    import docx

    document = docx.Document()
    for text in paragraphs:
        document.add_paragraph(text)
    if table:
        grid = document.add_table(rows=len(table), cols=len(table[0]))
        for r, row in enumerate(table):
            for c, value in enumerate(row):
                grid.cell(r, c).text = value
    document.save(str(path))
    return path


HTML = """<!doctype html><html><head><title>Reactors</title><style>p { color: red }</style>
<script>var secret = "do not index";</script></head>
<body><nav>Home</nav><h1>The alpha reactor</h1>
<p>It was designed by <b>Mira Okafor</b>
   in 1999.</p><p>It runs on salt&nbsp;&amp; sand.<br>Second line.</p>
<noscript>enable scripts</noscript><ul><li>one</li><li>two</li></ul>
<pre>keep   this
  spacing</pre></body></html>"""


def test_pdf_pages_are_read(tmp_path: Path) -> None:
    path = tmp_path / "report.PDF"  # suffixes are case-insensitive
    path.write_bytes(minimal_pdf("The alpha reactor runs on salt.", "Mira Okafor designed it."))
    loaded = load_documents(path)
    assert not loaded.skipped
    (doc_id, text, source), = loaded.docs
    assert text == "The alpha reactor runs on salt.\n\nMira Okafor designed it."
    assert doc_id == source == str(path)


def test_encrypted_and_broken_pdfs_are_skipped_with_a_reason(tmp_path: Path) -> None:
    (tmp_path / "locked.pdf").write_bytes(encrypted_pdf("hidden text"))
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.4\nthis is not a pdf at all")
    loaded = load_documents(tmp_path)
    assert not loaded.docs
    reasons = dict(loaded.skipped)
    assert reasons[str(tmp_path / "locked.pdf")] == "encrypted"
    assert reasons[str(tmp_path / "broken.pdf")].startswith(("unreadable PDF", "no text layer"))


def test_pdf_with_an_empty_user_password_is_read(tmp_path: Path) -> None:
    path = tmp_path / "owner-only.pdf"
    path.write_bytes(encrypted_pdf("Open to everyone.", password=""))
    assert load_documents(path).docs[0][1] == "Open to everyone."


def test_docx_paragraphs_and_tables_are_read(tmp_path: Path) -> None:
    path = write_docx(tmp_path / "notes.docx", ["Beta station orbits the moon.", "", "Its commander is Jonas Reyes."],
                      table=[["crew", "role"], ["Reyes", "commander"]])
    (_, text, _), = load_documents(path).docs
    assert text == ("Beta station orbits the moon.\n\nIts commander is Jonas Reyes.\n\n"
                    "crew | role\nReyes | commander")


def test_html_visible_text_keeps_paragraphs_and_drops_scripts(tmp_path: Path) -> None:
    text = html_text(HTML)
    assert "secret" not in text and "color" not in text and "enable scripts" not in text
    assert text.split("\n\n")[:4] == ["Reactors", "Home", "The alpha reactor",
                                      "It was designed by Mira Okafor in 1999."]
    assert "It runs on salt & sand.\nSecond line." in text
    assert "one\n\ntwo" in text and "keep   this\n  spacing" in text
    path = tmp_path / "page.htm"
    path.write_text(HTML)
    assert load_documents(path).docs[0][1] == text


def test_html_in_a_declared_legacy_charset(tmp_path: Path) -> None:
    path = tmp_path / "old.html"
    path.write_bytes('<meta charset="iso-8859-1"><p>Caf\xe9 cr\xe8me</p>'.encode("latin-1"))
    assert load_documents(path).docs[0][1] == "Café crème"


def test_folder_reports_what_it_skips_and_ignores_hidden_files(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("Gamma labs moved to Lisbon.")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02")
    (tmp_path / "script.py").write_text("print('hi')")
    (tmp_path / "legacy.doc").write_bytes(b"\xd0\xcf\x11\xe0")
    (tmp_path / "empty.md").write_text("  \n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("[core]")
    (tmp_path / ".DS_Store").write_bytes(b"\x00")
    loaded = load_documents(tmp_path)
    assert [d[1] for d in loaded.docs] == ["Gamma labs moved to Lisbon."]
    assert dict(loaded.skipped) == {
        str(tmp_path / "blob.bin"): "not text",
        str(tmp_path / "empty.md"): "empty",
        str(tmp_path / "legacy.doc"): "old Word format: save it as .docx",
        str(tmp_path / "script.py"): "unsupported type .py",
    }


def test_a_file_named_directly_is_read_as_text_whatever_its_suffix(tmp_path: Path) -> None:
    path = tmp_path / "NOTES"
    path.write_text("Delta works on tides.")
    assert load_documents(path).docs[0][1] == "Delta works on tides."
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    assert load_documents(tmp_path / "latin.txt").skipped[0][1].startswith("not UTF-8")


def test_skipped_summary_is_one_line_and_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert skipped_summary([]) == ""
    assert skipped_summary([("a.bin", "not text"), ("b.pdf", "encrypted")]) == \
        "skipped 2 files: a.bin (not text), b.pdf (encrypted)"
    many = [(f"f{i}.bin", "not text") for i in range(7)]
    assert skipped_summary(many, limit=2) == "skipped 7 files: f0.bin (not text), f1.bin (not text) and 5 more"
    assert skipped_summary([("x.jsonl#3", "record without a 'text' string")]).startswith("skipped 1 item: ")
    (tmp_path / "a.bin").write_bytes(b"\x00")
    (tmp_path / "b.bin").write_bytes(b"\x00")
    with caplog.at_level(logging.WARNING, logger="kvrag.indexing.documents"):
        load_documents(tmp_path)
    assert [r.getMessage() for r in caplog.records] == [
        f"skipped 2 files: {tmp_path / 'a.bin'} (not text), {tmp_path / 'b.bin'} (not text)"]


def test_loaded_passes_through_unchanged() -> None:
    loaded = Loaded(docs=[("d", "text", "s")], skipped=[("x", "empty")])
    assert load_documents(loaded) is loaded
    merged = load_documents([loaded, "more text"])
    assert [d[1] for d in merged.docs] == ["text", "more text"] and merged.skipped == [("x", "empty")]


def test_json_records_and_invalid_json(tmp_path: Path) -> None:
    (tmp_path / "r.jsonl").write_text('{"title": "T", "text": "body"}\n{"no": "text"}\n')
    (tmp_path / "bad.json").write_text("{oops")
    loaded = load_documents(tmp_path)
    assert [d[1] for d in loaded.docs] == ["T\nbody"]
    assert dict(loaded.skipped) == {str(tmp_path / "bad.json"): "invalid JSON at line 1",
                                    f"{tmp_path / 'r.jsonl'}#1": "record without a 'text' string"}
