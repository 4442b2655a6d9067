"""Document parts: PDF, DOCX, XLSX, CSV and text files inside a message, as text for the model.

Owns :func:`read_document` (a part's bytes to text by its media type, with maintained readers:
pypdf, python-docx, openpyxl; CSV and text as UTF-8), :class:`Document` (a document's text as
it stands in its message: ``<document name="...">`` … ``</document>``), and
:func:`fit_documents`, which cuts documents to the room the window leaves: when the prompt
with every document whole does not leave the request's output budget, each document keeps
its first 70 % and last 30 % of its share of the room, joined by a visible marker saying how
many tokens of which document were left out. The seed's gateway added this after users' PDFs
were silently dropped: a part is read or refused, never skipped.

Refusals (400, naming the part): a media type not listed here, base64 that does not decode, a
file its reader cannot open, a PDF with no text layer (scanned pages: there is no OCR here),
an office file whose zip would unpack past :data:`MAX_UNPACKED` bytes, and more than
:data:`MAX_TEXT_CHARS` characters of text from one document.

Example::

    text = read_document("report.pdf", "application/pdf", data, "messages[0].content[1]")
    doc = Document.of("report.pdf", text)
    Message("user", "Summarize this.\\n" + doc.block)
"""

from __future__ import annotations

import base64
import binascii
import csv
import io
import zipfile
from collections.abc import Sequence

import attrs

from pipeline.errors import ContextWindowError, InvalidValueError
from pipeline.pipe import Pipeline
from pipeline.prepared import Prepared
from pipeline.contracts.request import Request
from transports.http.dialects.fields import Obj

PDF = "application/pdf"
DOCX = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
XLSX = "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"
CSV = "text/csv"
TEXT_TYPES = ("text/plain", "text/markdown", CSV)
MEDIA_TYPES = (PDF, DOCX, XLSX, *TEXT_TYPES)
"""The media types a document part may have."""
EXTENSIONS = {".pdf": PDF, ".docx": DOCX, ".xlsx": XLSX, ".csv": CSV, ".txt": "text/plain",
              ".md": "text/markdown"}
"""A file name's ending, for a part that names no media type."""
MAX_UNPACKED = 64 << 20
"""The most an office file's zip may unpack to (a small zip can unpack to gigabytes)."""
MAX_TEXT_CHARS = 4 << 20
"""The most text one document may give (the window is far smaller; this bounds the work)."""
HEAD = 0.7
"""The share of a cut document's room its beginning keeps (the end keeps the rest)."""
MIN_ROOM = 32
"""Tokens a document keeps at the least when cut (below that it is not worth sending)."""


@attrs.frozen
class Document:
    """A document's ``name`` and ``text``, and the ``block`` its message holds."""

    name: str
    text: str

    @property
    def block(self) -> str:
        """The text as the message holds it."""
        return self.wrapped(self.text)

    def wrapped(self, text: str) -> str:
        """``text`` between this document's markers."""
        return f'<document name="{self.name}">\n{text}\n</document>'

    @classmethod
    def of(cls, name: str, text: str) -> Document:
        """A document named ``name`` (quotes and angle brackets taken out of the name)."""
        return cls(name.translate({ord(c): None for c in '"<>\n\r'}) or "document", text)


def media_type(name: str | None, given: str | None, path: str) -> str:
    """The part's media type: the one given, else its file name's ending's."""
    if given:
        kind = given.split(";")[0].strip().lower()
    else:
        ending = "." + name.rsplit(".", 1)[-1].lower() if name and "." in name else ""
        kind = EXTENSIONS.get(ending, "")
    if kind not in MEDIA_TYPES:
        raise InvalidValueError(path, given or name, "is not a document type read here: "
                                f"{', '.join(MEDIA_TYPES)}")
    return kind


def decode_base64(data: str, path: str) -> bytes:
    """A part's base64 data (a ``data:`` URL's payload too)."""
    if data.startswith("data:"):
        head, comma, data = data.partition(",")
        if ";base64" not in head or not comma:
            raise InvalidValueError(path, head, "a data URL must be base64, its data after a "
                                    "comma")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidValueError(path, "(data)", f"is not valid base64: {exc}") from None


def read_document(name: str, kind: str, data: bytes, path: str) -> str:
    """The text of a document of media type ``kind``; :class:`InvalidValueError` naming
    ``path`` when it cannot be read (see the module docstring)."""
    try:
        if kind == PDF:
            text = _pdf(data, path)
        elif kind == DOCX:
            text = _docx(data, path)
        elif kind == XLSX:
            text = _xlsx(data, path)
        else:
            text = data.decode("utf-8-sig")
    except InvalidValueError:
        raise
    except UnicodeDecodeError as exc:
        raise InvalidValueError(path, name, f"is not UTF-8 text: {exc.reason}") from None
    except Exception as exc:  # a reader's own error: the file is damaged or not that type
        raise InvalidValueError(path, name, f"cannot be read as {kind}: {exc}") from None
    if len(text) > MAX_TEXT_CHARS:
        raise InvalidValueError(path, name, f"gives {len(text)} characters of text, more than "
                                f"{MAX_TEXT_CHARS}")
    return text.replace("\x00", "")


def file_data(holder: Obj, name: str | None) -> Document:
    """The document in ``holder``'s ``file_data`` (base64 or a data URL, whose media type
    counts), named ``name``: an OpenAI ``file`` part's or a Responses ``input_file``'s."""
    data, at = holder.need("file_data", "string"), holder.at("file_data")
    given = data[5:data.index(";")] if data.startswith("data:") and ";" in data else None
    text = read_document(name or "file", media_type(name, given, at), decode_base64(data, at), at)
    return Document.of(name or "file", text)


def _pdf(data: bytes, path: str) -> str:
    from pypdf import PdfReader

    reader = PdfReader(io.BytesIO(data))  # pypdf caps what one stream may inflate to
    pages: list[str] = []
    size = 0
    for page in reader.pages:  # stop as soon as the text is too long to keep
        pages.append((page.extract_text() or "").strip())
        size += len(pages[-1])
        if size > MAX_TEXT_CHARS:
            raise InvalidValueError(path, f"{len(pages)} page(s)", "gives more than "
                                    f"{MAX_TEXT_CHARS} characters of text")
    text = "\n\n".join(p for p in pages if p)
    if not text:
        raise InvalidValueError(path, f"{len(pages)} page(s)", "is a PDF with no text layer "
                                "(scanned pages?): there is no OCR here; send its text")
    return text


def _unpacked(data: bytes, path: str) -> None:
    """Refuse an office file whose zip unpacks past :data:`MAX_UNPACKED` bytes."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        total = sum(i.file_size for i in z.infolist())
    if total > MAX_UNPACKED:
        raise InvalidValueError(path, total, f"unpacks to more than {MAX_UNPACKED} bytes")


def _docx(data: bytes, path: str) -> str:
    import docx

    _unpacked(data, path)
    document = docx.Document(io.BytesIO(data))
    lines = [p.text for p in document.paragraphs]
    for table in document.tables:
        for row in table.rows:
            lines.append("\t".join(cell.text for cell in row.cells))
    return "\n".join(lines).strip()


def _xlsx(data: bytes, path: str) -> str:
    import openpyxl

    _unpacked(data, path)
    book = openpyxl.load_workbook(io.BytesIO(data), read_only=True, data_only=True)
    try:
        out = io.StringIO()
        for sheet in book.worksheets:
            out.write(f"# {sheet.title}\n")
            writer = csv.writer(out, lineterminator="\n")
            for row in sheet.iter_rows(values_only=True):
                writer.writerow(["" if v is None else v for v in row])
                if out.tell() > MAX_TEXT_CHARS:
                    raise InvalidValueError(path, sheet.title, "gives more than "
                                            f"{MAX_TEXT_CHARS} characters of text")
        return out.getvalue().strip()
    finally:
        book.close()


# --- fitting to the window ------------------------------------------------------------------

def fit_documents(pipe: Pipeline, request: Request, documents: Sequence[Document],
                  window: int, field: str) -> Prepared:
    """``request`` prepared, its ``documents`` cut so that the prompt leaves its
    ``max_tokens`` within ``window``: each document's share of the room is its share of the
    documents' tokens; a cut document keeps the first :data:`HEAD` of its share and the
    rest from its end, with a marker between. Whole when they fit; a
    :class:`~pipeline.errors.ContextWindowError` naming ``field`` when even
    :data:`MIN_ROOM` tokens a document would not fit."""
    prepared = pipe.prepare(request)
    need = request.generation_config.max_tokens
    if not documents or len(prepared.tokens) + need <= window:
        return prepared
    tok = pipe.stages.tokenizer
    assert tok is not None
    ids = [tok.encode_text(d.text) for d in documents]
    bare = _with_texts(request, documents, ["" for _ in documents])
    room = window - need - len(pipe.prepare(bare).tokens)
    for _ in range(3):  # a cut text may tokenize a few tokens longer in its place
        if room < MIN_ROOM * len(documents):
            raise ContextWindowError(field, len(prepared.tokens), window - need)
        total = sum(len(i) for i in ids) or 1
        texts = [_cut(tok, d.name, i, max(MIN_ROOM, room * len(i) // total))
                 for d, i in zip(documents, ids)]
        prepared = pipe.prepare(_with_texts(request, documents, texts))
        over = len(prepared.tokens) + need - window
        if over <= 0:
            return prepared
        room -= over + 8
    raise ContextWindowError(field, len(prepared.tokens), window - need)


def _cut(tok: object, name: str, ids: list[int], room: int) -> str:
    """The document's text in ``room`` tokens: whole if it fits, else its head and tail
    around a marker."""
    decode = getattr(tok, "decode")
    if len(ids) <= room:
        return str(decode(ids, skip_special_tokens=False))
    marker = f"\n[... {{}} tokens of {name} left out to fit the context window ...]\n"
    keep = max(2, room - 24)  # the marker's own tokens
    head = int(keep * HEAD)
    tail = keep - head
    left_out = len(ids) - head - tail
    return (str(decode(ids[:head], skip_special_tokens=False)) + marker.format(left_out)
            + str(decode(ids[len(ids) - tail:], skip_special_tokens=False)))


def _with_texts(request: Request, documents: Sequence[Document], texts: Sequence[str]
                ) -> Request:
    """``request`` with each document's text in its message replaced by ``texts``."""
    todo = list(zip(documents, texts))
    messages = []
    for message in request.messages:
        content = message.content
        rest = []
        for doc, text in todo:
            if content is not None and doc.block in content:
                content = content.replace(doc.block, doc.wrapped(text), 1)
            else:
                rest.append((doc, text))
        todo = rest
        messages.append(message if content == message.content
                        else attrs.evolve(message, content=content))
    return attrs.evolve(request, messages=tuple(messages))

