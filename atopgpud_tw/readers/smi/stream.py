"""Parsing a ``-q -x`` report a slice at a time, keeping only what the reader reads.

A report may be large (32 MiB is let through, `child.MAX_OUTPUT`), and a whole
ElementTree of one costs about six times its size.  `ReportParser` never builds an
element the reader has no use for: at the top only ``<gpu>`` (and `VERSIONS`), in
a ``<gpu>`` only the subtrees in `KEPT`, in a ``<process_info>`` only
`PROCESS_FIELDS`.  What it may cost is capped:

`MAX_ELEMENTS` elements, `MAX_DEPTH` deep, else the report fails; `MAX_GPU_PROCESSES`
per GPU and `MAX_PROCESSES` in all, else the GPU's list is emptied and marked (`OVER`),
as a partial list would make the rest seem to end; no entity declarations; `MAX_TEXT`
characters of a text (its ends about an ellipsis) and of an attribute, the element
marked (`CUT`): a product name of 30 MB made a 503 MB ``/metrics``.  Processes are
tuples of strings (`ProcessList`), not elements, which the garbage collector walks at
every full collection, holding up the reactor too.
"""

from __future__ import annotations

import re
import time
import xml.etree.ElementTree as ET

from atopgpud_tw.figures import FIGURES, INVENTORY
from atopgpud_tw.readers.smi.values import MAX_TEXT, SmiReportError, first_line

#: seconds the parsing thread sleeps after each chunk, so that the reactor gets the interpreter
YIELD = 0.0002
#: bytes handed to expat at once
SLICE = 64 * 1024
#: the children of a ``<gpu>`` the reader reads: report.py's and mig.py's, the inventory's, the table of figures'
KEPT = frozenset(
    {"uuid", "product_name", "pci", "mig_mode", "utilization", "fb_memory_usage", "processes", "mig_devices"}
    | {row.smi.split("/")[0] for row in INVENTORY if not row.smi_root}
    | {path.split("/")[0] for figure in FIGURES if figure.smi is not None
       for path in (*figure.smi.paths, *(name for names in figure.smi.parts for name in names))}
)  # fmt: skip
#: the children of ``<nvidia_smi_log>`` kept besides the ``<gpu>`` elements (the inventory's versions)
VERSIONS = frozenset(row.smi for row in INVENTORY if row.smi_root)
#: the children of a ``<process_info>`` the reader reads, in the order of a `ProcessList` entry
PROCESS_FIELDS = ("pid", "type", "used_memory", "gpu_instance_id", "compute_instance_id")
_FIELD = {name: index for index, name in enumerate(PROCESS_FIELDS)}
#: elements kept outside the process lists (a real GPU needs about 150)
MAX_ELEMENTS = 65536
#: processes kept per GPU, and in the whole report
MAX_GPU_PROCESSES = 4096
MAX_PROCESSES = 8192
#: how deep elements may nest (a report nests 6 deep)
MAX_DEPTH = 64
#: text before the document looked through for its start (warnings nvidia-smi prints)
MAX_PREAMBLE = 64 * 1024
#: the attribute marking a ``<processes>`` whose GPU listed more than the caps allow, saying how
OVER = "atopgpud-over"
#: the attribute marking an element whose text was cut to `MAX_TEXT`, saying how long it was
CUT = "atopgpud-cut"
#: what stands for the middle of a cut text: its first `_HEAD` and last `_TAIL` characters are kept
ELLIPSIS = "\u2026"
_HEAD = MAX_TEXT // 2 - 1
_TAIL = MAX_TEXT // 2

_REPORT_START = re.compile(rb"<\?xml|<nvidia_smi_log[\s>/]")
_ENTITY = b"<!ENTITY"


class ProcessList(ET.Element):
    """A kept ``<processes>``: each ``<process_info>`` as the texts of its `PROCESS_FIELDS` (the first
    such child's character data, stripped, as `values.text_at` reads it; None where it is missing)."""

    entries: list[tuple[str | None, ...]]


def _element(tag: str, attributes: dict[str, str]) -> ET.Element:
    if tag == "processes":
        listing = ProcessList(tag, attributes)
        listing.entries = []
        return listing
    return ET.Element(tag, attributes)


class ReportParser:
    """One report's output, fed as it comes (`feed`), its kept elements at `close`."""

    def __init__(self) -> None:
        self._head = b""
        self._blank = True
        #: what was printed before the document, once its start was found
        self._preamble: bytes | None = None
        self._target = _Keeper()
        self._parser = ET.XMLParser(target=self._target)
        #: the end of the previous slice, to find a declaration split between two
        self._tail = b""

    def feed(self, data: bytes) -> None:
        """Parse `data`, the next part of the output; SmiReportError if it is no report."""
        self._blank = self._blank and not data.strip()
        if self._preamble is None:
            self._head += data
            # looked for in the first MAX_PREAMBLE bytes, however the output was cut
            start = _REPORT_START.search(self._head, 0, MAX_PREAMBLE + 16)
            if start is None and len(self._head) < MAX_PREAMBLE:
                return
            data = self._begin(start.start() if start is not None else 0)
        view = memoryview(data)
        for offset in range(0, len(data), SLICE):
            self._parse(bytes(view[offset : offset + SLICE]))

    def close(self) -> tuple[ET.Element, str]:
        """The ``<nvidia_smi_log>`` element, and the first line of what was printed before it."""
        if self._blank:
            raise SmiReportError("the output is empty")
        if self._preamble is None:
            self._parse(self._begin(0))  # no start found: parsed as it is, and refused
        try:
            root = self._parser.close()
        except ET.ParseError as error:
            raise SmiReportError(f"the output is not XML ({error})") from None
        assert self._preamble is not None
        return root, first_line(self._preamble.decode("utf-8", errors="replace"))

    def _begin(self, at: int) -> bytes:
        """The document's start is at `at` in what was held back: the rest is parsed."""
        self._preamble, data, self._head = self._head[:at], self._head[at:], b""
        return data

    def _parse(self, piece: bytes) -> None:
        if _ENTITY in self._tail + piece[: len(_ENTITY)] or _ENTITY in piece:
            raise SmiReportError("the output declares XML entities, which no nvidia-smi report does")
        self._tail = piece[1 - len(_ENTITY) :]
        try:
            self._parser.feed(piece)
        except ET.ParseError as error:
            raise SmiReportError(f"the output is not XML ({error})") from None


class _Keeper:
    """The parser's target: hands the elements kept to a TreeBuilder, and ignores the rest."""

    def __init__(self) -> None:
        self._builder = ET.TreeBuilder(element_factory=_element)
        #: the tags of the open elements, the root first, and whether each is kept
        self._tags: list[str] = []
        self._kept: list[bool] = []
        self._elements = 0
        self._processes = 0
        self._gpu_processes = 0
        #: the GPU's ``<processes>``, the fields of its process being read, the field being gathered
        self._list: ProcessList | None = None
        self._fields: list[str | None] | None = None
        self._field: int | None = None
        self._text: list[str] = []
        self._text_size = 0
        #: the kept elements open; the text held since the last start or end: size, head, tail once cut
        self._open: list[ET.Element] = []
        self._size = 0
        self._held: list[str] = []
        self._last: str | None = None
        self._blank = True

    def start(self, tag: str, attributes: dict[str, str]) -> None:
        depth = len(self._tags)
        if depth >= MAX_DEPTH:
            raise SmiReportError(f"the report nests elements deeper than {MAX_DEPTH}")
        if depth == 4 and self._fields is not None:
            index = _FIELD.get(tag)
            if index is not None and self._fields[index] is None:
                self._field, self._text, self._text_size = index, [], 0
        keep = (not self._kept or self._kept[-1]) and self._keeps(tag, depth)
        self._tags.append(tag)
        self._kept.append(keep)
        if keep:
            self._flush()
            longest = max(map(len, attributes.values()), default=0)
            if longest > MAX_TEXT:
                attributes = {name: value[:MAX_TEXT] for name, value in attributes.items()}
            element = self._builder.start(tag, attributes)
            if longest > MAX_TEXT:
                element.set(CUT, str(longest))
            self._open.append(element)
            if depth == 2 and isinstance(element, ProcessList):
                self._list = element

    def end(self, tag: str) -> None:
        depth = len(self._tags) - 1
        self._tags.pop()
        kept = self._kept.pop()
        if self._fields is not None and depth <= 4:
            self._end_field(depth)
        elif kept:
            self._flush()
            self._builder.end(tag)
            self._open.pop()

    def data(self, text: str) -> None:
        if self._field is not None:
            if self._text_size < MAX_TEXT:
                self._text.append(text[: MAX_TEXT - self._text_size])
            self._text_size += len(text)
        elif self._kept and self._kept[-1] and self._fields is None:
            self._size += len(text)
            self._blank = self._blank and not text.strip()
            if self._last is not None:
                self._last = (self._last + text)[-_TAIL:]
                return
            self._held.append(text)
            if self._size > MAX_TEXT:
                held = "".join(self._held)
                self._held, self._last = [held[:_HEAD]], held[-_TAIL:]

    def _flush(self) -> None:
        """Hand the text held to the builder: whole, or its ends about an ellipsis (a cut figure never reads
        as a number), its element marked."""
        text = "".join(self._held)
        if self._last is not None and not self._blank:
            text += ELLIPSIS + self._last
            if self._open:
                self._open[-1].set(CUT, str(self._size))
        if text:
            self._builder.data(text)
        self._held, self._last, self._size, self._blank = [], None, 0, True

    def close(self) -> ET.Element:
        return self._builder.close()

    def _keeps(self, tag: str, depth: int) -> bool:
        """Whether an element `tag`, starting under the open (kept) ones, is kept."""
        if depth == 0:
            if tag != "nvidia_smi_log":
                raise SmiReportError(f"the document is <{tag}>, not <nvidia_smi_log>")
        elif depth == 1:
            if tag != "gpu" and tag not in VERSIONS:
                return False
            self._gpu_processes, self._list = 0, None
        elif depth == 2 and tag not in KEPT:
            return False
        elif depth == 3 and self._tags[2] == "processes":
            if tag == "process_info" and self._take_process():
                self._fields = [None] * len(PROCESS_FIELDS)
            return False  # gathered into the ProcessList, not built
        self._elements += 1
        if self._elements > MAX_ELEMENTS:
            raise SmiReportError(f"the report has more than {MAX_ELEMENTS} elements to read")
        return True

    def _end_field(self, depth: int) -> None:
        """A field (depth 4) or a ``<process_info>`` (depth 3) of a process being gathered ends."""
        assert self._fields is not None
        if depth == 4 and self._field is not None:
            self._fields[self._field] = "".join(self._text).strip()
            self._field, self._text = None, []
        elif depth == 3:
            if self._list is not None and self._list.get(OVER) is None:
                self._list.entries.append(tuple(self._fields))
            self._fields = None

    def _take_process(self) -> bool:
        """Whether one more ``<process_info>`` of this GPU is kept; past a cap, none is."""
        listing = self._list
        if listing is None or listing.get(OVER) is not None:
            return False
        self._gpu_processes += 1
        self._processes += 1
        if self._gpu_processes <= MAX_GPU_PROCESSES and self._processes <= MAX_PROCESSES:
            return True
        self._processes -= self._gpu_processes
        listing.entries = []  # the ones kept so far go too
        listing.set(OVER, f"more than {MAX_GPU_PROCESSES} processes" if self._gpu_processes > MAX_GPU_PROCESSES
                    else f"processes beyond the {MAX_PROCESSES} a report may have")
        return False


def read_report(data: bytes) -> tuple[ET.Element, str]:
    """A whole output at once: the ``<nvidia_smi_log>`` element, and the first line printed before it
    (nvidia-smi writes some warnings, "WARNING: infoROM is corrupted at gpu ...", ahead of the XML)."""
    return parse_output([data])


def parse_output(chunks: list[bytes]) -> tuple[ET.Element, str]:
    """`read_report` over an output in chunks, each let go of once parsed.  Run in a thread: after each
    chunk (8 KiB as the reactor reads a pipe) the interpreter is offered to the reactor, which would
    otherwise wait for it up to the switch interval (5 ms) at every system call of a reply."""
    parser = ReportParser()
    for index in range(len(chunks)):
        chunk, chunks[index] = chunks[index], b""
        parser.feed(chunk)
        time.sleep(YIELD)
    return parser.close()
