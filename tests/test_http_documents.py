"""Document parts over HTTP: PDF, DOCX, XLSX, CSV and text in both dialects, read to text.

The files are made here by the formats' own writers (python-docx, openpyxl; a PDF written
byte by byte with a text layer, and a blank one written by pypdf). The model is scripted to
read its prompt: it answers "found" when the secret the file holds (PLUM-42) reached it,
"missing" when not, and, for a document cut to the window, "cut" when the prompt holds the
document's first and last words around the marker with the head about 70 % of what was kept.
Oracles: the files' own contents, the official SDKs' parsing and errors, and transformers'
chat template and tokenizer for the exact prompt size of a document message.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator, Sequence
from typing import Any

import anthropic
import docx
import openai
import openpyxl
import pytest
from pypdf import PdfWriter
from transformers import AutoTokenizer

from pipeline.builder import build
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.pipe import Pipeline
from pipeline.testing import ScriptedBackend, peaked
from stages.tokenize import HFTokenizer
from tests.http_support import IM_END, IM_START, config, running
from transports.http import Gateway

SECRET = "PLUM-42"
MARKER = "left out to fit the context window"


def reader_model() -> Pipeline:
    """The scripted reader of the module docstring."""
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    header = len(tok.encode_text("assistant\n"))

    def verdict(prompt: str) -> str:
        if MARKER in prompt:
            before, _, after = prompt.partition(MARKER)
            head = before[before.rindex("BEGIN-MARK"):]
            tail = after[:after.index("END-MARK")]
            share = len(tok.encode_text(head)) / (len(tok.encode_text(head))
                                                   + len(tok.encode_text(tail)))
            return "cut" if 0.6 < share < 0.8 else f"share {share:.2f}"
        return "found" if SECRET in prompt else "missing"

    def choose(ids: Sequence[int]) -> int:
        start = len(ids) - 1 - list(reversed(ids)).index(IM_START)
        produced = len(ids) - (start + 1 + header)
        script = tok.encode_text(verdict(tok.decode(list(ids[:start]),
                                                    skip_special_tokens=False))) + [IM_END]
        return script[min(produced, len(script) - 1)]

    backend = ScriptedBackend(tok.vocab_size, peaked(tok.vocab_size, choose, 30.0))
    return build(TINY_MODEL_DIR, backend=backend)


# --- the files ---------------------------------------------------------------------------------

def pdf_with_text(text: str) -> bytes:
    """A one-page PDF whose text layer is ``text`` (Helvetica), written by hand."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
               b"/Resources << /Font << /F1 5 0 R >> >> >>",
               b"<< /Length " + str(len(stream)).encode() + b" >>\nstream\n" + stream
               + b"\nendstream",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for n, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{n} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{o:010d} 00000 n \n".encode() for o in offsets)
    out += (f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n"
            .encode())
    return bytes(out)


def blank_pdf() -> bytes:
    writer = PdfWriter()
    writer.add_blank_page(width=612, height=792)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def docx_file() -> bytes:
    document = docx.Document()
    document.add_paragraph("Quarterly notes.")
    table = document.add_table(rows=1, cols=2)
    table.rows[0].cells[0].text, table.rows[0].cells[1].text = "code", SECRET
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def xlsx_file() -> bytes:
    book = openpyxl.Workbook()
    sheet = book.active
    assert sheet is not None
    sheet.append(["item", "code"])
    sheet.append(["launch", SECRET])
    out = io.BytesIO()
    book.save(out)
    return out.getvalue()


FILES = {
    "notes.pdf": ("application/pdf", lambda: pdf_with_text(f"The code is {SECRET}.")),
    "notes.docx": ("application/vnd.openxmlformats-officedocument.wordprocessingml.document",
                   docx_file),
    "sheet.xlsx": ("application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
                   xlsx_file),
    "table.csv": ("text/csv", lambda: f"item,code\nlaunch,{SECRET}\n".encode()),
    "plain.txt": ("text/plain", lambda: f"The code is {SECRET}.".encode()),
}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    gateway = Gateway(config(tmp_path_factory.mktemp("docs"), max_context=600),
                      lambda f, c: reader_model())
    with running(gateway) as base:
        yield base
    gateway.close()


def ask_openai(url: str, part: dict[str, Any], max_tokens: int = 8) -> str:
    oa = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
    chat = oa.chat.completions.create(model="default", max_tokens=max_tokens, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is the code?"}, part]}])
    return chat.choices[0].message.content or ""  # type: ignore[call-overload]


def ask_anthropic(url: str, block: dict[str, Any], max_tokens: int = 8) -> str:
    an = anthropic.Anthropic(base_url=url, api_key="-", max_retries=0)
    reply = an.messages.create(model="default", max_tokens=max_tokens, messages=[
        {"role": "user", "content": [block, {"type": "text", "text": "What is the code?"}]}])
    return "".join(b.text for b in reply.content if b.type == "text")  # type: ignore[call-overload]


@pytest.mark.parametrize("name", sorted(FILES))
def test_every_kind_of_file_reaches_the_model_in_both_dialects(url: str, name: str) -> None:
    media, make = FILES[name]
    data = make()
    openai_part = {"type": "file", "file": {"filename": name,
                                            "file_data": f"data:{media};base64,{b64(data)}"}}
    assert ask_openai(url, openai_part) == "found"
    anthropic_block = {"type": "document", "title": name,
                       "source": {"type": "base64", "media_type": media, "data": b64(data)}}
    assert ask_anthropic(url, anthropic_block) == "found"
    oa = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
    response = oa.responses.create(model="default", max_output_tokens=8, input=[{
        "role": "user", "content": [
            {"type": "input_text", "text": "What is the code?"},
            {"type": "input_file", "filename": name,
             "file_data": f"data:{media};base64,{b64(data)}"}]}])  # type: ignore[misc, list-item]
    assert response.output_text == "found"


def test_a_document_message_is_the_text_the_template_is_given(url: str) -> None:
    # the prompt size the server counts equals transformers' count of the message with the
    # document's text on lines of its own between its markers
    text = f"The code is {SECRET}."
    an = anthropic.Anthropic(base_url=url, api_key="-", max_retries=0)
    counted = an.messages.count_tokens(model="default", messages=[{"role": "user", "content": [
        {"type": "text", "text": "Read:"},
        {"type": "document", "title": "plain.txt",
         "source": {"type": "text", "media_type": "text/plain", "data": text}}]}])
    hf = AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))
    content = f'Read:\n<document name="plain.txt">\n{text}\n</document>\n'
    want = hf.apply_chat_template([{"role": "user", "content": content}], tokenize=True,
                                  add_generation_prompt=True)["input_ids"]
    assert counted.input_tokens == len(want)


def test_a_long_document_is_cut_to_the_window_head_and_tail(url: str) -> None:
    words = " ".join(f"w{i}" for i in range(3000))
    text = f"BEGIN-MARK {words} END-MARK"
    part = {"type": "file", "file": {"filename": "long.txt",
                                     "file_data": f"data:text/plain;base64,{b64(text.encode())}"}}
    assert ask_openai(url, part) == "cut"
    block = {"type": "document", "title": "long.txt",
             "source": {"type": "text", "media_type": "text/plain", "data": text}}
    assert ask_anthropic(url, block) == "cut"


def test_what_cannot_be_read_is_a_clear_400(url: str) -> None:
    blank = {"type": "file", "file": {"filename": "scan.pdf",
                                      "file_data": f"data:application/pdf;base64,"
                                                   f"{b64(blank_pdf())}"}}
    with pytest.raises(openai.BadRequestError, match="no text layer"):
        ask_openai(url, blank)
    with pytest.raises(anthropic.BadRequestError, match="no text layer"):
        ask_anthropic(url, {"type": "document", "source": {
            "type": "base64", "media_type": "application/pdf", "data": b64(blank_pdf())}})
    with pytest.raises(openai.BadRequestError, match="not a document type"):
        ask_openai(url, {"type": "file", "file": {"filename": "x.png",
                                                  "file_data": "data:image/png;base64,AAAA"}})
    with pytest.raises(openai.BadRequestError, match="uploaded files"):
        ask_openai(url, {"type": "file", "file": {"file_id": "file-123"}})
    with pytest.raises(openai.BadRequestError, match="not valid base64"):
        ask_openai(url, {"type": "file", "file": {"filename": "a.txt",
                                                  "file_data": "data:text/plain;base64,@@@"}})
    with pytest.raises(openai.BadRequestError, match="after a comma"):
        ask_openai(url, {"type": "file", "file": {"filename": "a.txt",
                                                  "file_data": "data:text/plain;base64"}})
    with pytest.raises(anthropic.BadRequestError, match="cannot be read"):
        ask_anthropic(url, {"type": "document", "source": {
            "type": "base64", "media_type": FILES["notes.docx"][0], "data": b64(b"not a zip")}})
    with pytest.raises(anthropic.BadRequestError, match="URL"):
        ask_anthropic(url, {"type": "document", "source": {"type": "url",
                                                           "url": "https://example.com/a.pdf"}})


def test_the_reader_answers_missing_without_the_secret(url: str) -> None:
    # the scripted reader is no rubber stamp: a document without the code is "missing"
    part = {"type": "file", "file": {"filename": "other.txt",
                                     "file_data": f"data:text/plain;base64,{b64(b'no code')}"}}
    assert ask_openai(url, part) == "missing"
