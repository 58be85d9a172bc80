"""The incremental parse of ``-q -x`` (readers/smi/stream.py): what is kept, in any slicing, within caps."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from smi_doubles import FIXTURES

from atopgpud_tw.readers.smi import stream
from atopgpud_tw.readers.smi.health import read_cards_health
from atopgpud_tw.readers.smi.mig import mig_slots
from atopgpud_tw.readers.smi.report import parse_report, read_devices
from atopgpud_tw.readers.smi.stream import OVER, ReportParser, parse_output, read_report
from atopgpud_tw.readers.smi.values import SmiReportError

SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "fixtures" / "nvidia-smi"
LOCAL = sorted(p for p in FIXTURES.glob("*.xml") if p.name != "not-a-report.xml")
CORPUS = sorted(SHARED.glob("*.xml")) if SHARED.is_dir() else []


def _everything(root: ET.Element) -> tuple:
    devices, problems = read_devices(root)
    cards, _ = read_devices(root, "card")
    health = [(h.key, h.name, sorted(h.values.items())) for h in read_cards_health(root)]
    return devices, cards, dict(problems), health, mig_slots(root)


@pytest.mark.parametrize("path", LOCAL + CORPUS, ids=lambda p: p.name)
def test_what_is_kept_reads_as_the_whole_report(path: Path) -> None:
    """Devices, MIG instances, problems and health figures are those of the whole tree."""
    data = path.read_bytes()
    whole = ET.fromstring(data[data.find(b"<"):])
    kept, _ = read_report(data)
    assert _everything(kept) == _everything(whole)


def test_the_corpus_is_there_or_said_to_be_missing() -> None:
    """The real reports come from the shared folder; without it only the local fixtures are compared."""
    if not CORPUS:
        pytest.skip(f"no real nvidia-smi reports at {SHARED}")
    assert len(CORPUS) >= 10


def test_elements_not_read_are_not_kept() -> None:
    """Supported clocks, accounting and the rest of a report are dropped; processes keep their fields."""
    data = (SHARED / "h100-80gb-hbm3-x8-570.86.15.xml") if CORPUS else FIXTURES / "plain-v11.xml"
    root, _ = read_report(data.read_bytes())
    assert {child.tag for child in root} == {"gpu"} | stream.VERSIONS
    for gpu in root.findall("gpu"):
        assert {child.tag for child in gpu} <= stream.KEPT
        listing = gpu.find("processes")
        if listing is not None:
            assert isinstance(listing, stream.ProcessList) and len(listing) == 0
            assert all(len(entry) == len(stream.PROCESS_FIELDS) for entry in listing.entries)


@pytest.mark.parametrize("size", [pytest.param(1, marks=pytest.mark.slow), 7, 100, 8192])
def test_any_slicing_gives_the_same_report(size: int) -> None:
    """The output may come in chunks of any size, cut anywhere (a preamble's too)."""
    data = b"WARNING: infoROM is corrupted at gpu 0000:17:00.0\n" + (FIXTURES / "mig.xml").read_bytes()
    whole_root, whole_preamble = read_report(data)
    root, preamble = parse_output([data[i : i + size] for i in range(0, len(data), size)])
    assert preamble == whole_preamble == "WARNING: infoROM is corrupted at gpu 0000:17:00.0"
    assert _everything(root) == _everything(whole_root)


def test_parse_output_lets_go_of_each_chunk() -> None:
    """Each chunk is dropped once parsed: the output is not held twice."""
    data = (FIXTURES / "plain-v11.xml").read_bytes()
    chunks = [data[:100], data[100:]]
    parse_output(chunks)
    assert chunks == [b"", b""]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "the output is empty"),
        (b"  \n\n ", "the output is empty"),
        (b"NVIDIA-SMI has failed", "the output is not XML (syntax error: line 1, column 0)"),
        (b"<other/>", "the document is <other>, not <nvidia_smi_log>"),
        (b"<nvidia_smi_log><gpu>", "the output is not XML (no element found: line 1, column 21)"),
    ],
)
def test_no_report_is_a_clear_error(data: bytes, message: str) -> None:
    with pytest.raises(SmiReportError) as raised:
        read_report(data)
    assert str(raised.value) == message


def _report(gpus: int, processes: int) -> bytes:
    info = (
        "<process_info><pid>{}</pid><type>C</type><process_name>x</process_name>"
        "<used_memory>1 MiB</used_memory></process_info>"
    )
    parts = ["<nvidia_smi_log>"]
    for index in range(gpus):
        parts.append(f'<gpu id="00000000:{index + 1:02X}:00.0"><uuid>GPU-{index}</uuid>')
        parts.append("<fb_memory_usage><total>100 MiB</total><used>1 MiB</used></fb_memory_usage><processes>")
        parts.extend(info.format(1000 * index + pid) for pid in range(processes))
        parts.append("</processes></gpu>")
    parts.append("</nvidia_smi_log>")
    return "".join(parts).encode()


def test_a_gpu_past_the_process_cap_has_no_list(monkeypatch) -> None:
    """Past MAX_GPU_PROCESSES a GPU's list is marked and emptied, and read as unreadable: no partial list."""
    monkeypatch.setattr(stream, "MAX_GPU_PROCESSES", 5)
    (device,), _ = parse_report(_report(1, 5))
    assert device.processes is not None and len(device.processes) == 5
    root, _ = read_report(_report(1, 6))
    assert root.find("gpu/processes").get(OVER) == "more than 5 processes"
    assert root.find("gpu/processes").entries == []
    (device,), problems = parse_report(_report(1, 6))
    assert device.processes is None
    assert "GPU 00000000:01:00.0 lists more than 5 processes: none of them is counted" in problems.values()


def test_the_report_wide_process_cap_leaves_out_the_gpus_past_it(monkeypatch) -> None:
    """Past MAX_PROCESSES in the report, the GPU that crosses it and later ones have no list; earlier keep theirs."""
    monkeypatch.setattr(stream, "MAX_PROCESSES", 7)
    devices, _ = parse_report(_report(3, 3))
    assert [None if d.processes is None else len(d.processes) for d in devices] == [3, 3, None]


def test_too_many_elements_fail_the_report(monkeypatch) -> None:
    monkeypatch.setattr(stream, "MAX_ELEMENTS", 50)
    data = b"<nvidia_smi_log><gpu>" + b"<uuid>x</uuid>" * 60 + b"</gpu></nvidia_smi_log>"
    with pytest.raises(SmiReportError, match="more than 50 elements to read"):
        read_report(data)
    # elements dropped cost no count
    data = b"<nvidia_smi_log><gpu><uuid>x</uuid>" + b"<supported_clocks/>" * 60 + b"</gpu></nvidia_smi_log>"
    read_report(data)


def test_deep_nesting_fails_the_report() -> None:
    depth = stream.MAX_DEPTH + 1
    data = b"<nvidia_smi_log>" + b"<a>" * depth + b"</a>" * depth + b"</nvidia_smi_log>"
    with pytest.raises(SmiReportError, match=f"deeper than {stream.MAX_DEPTH}"):
        read_report(data)


@pytest.mark.parametrize("cut", [0, 3, 5, 9])
def test_entity_declarations_are_refused_wherever_the_chunks_cut(cut: int) -> None:
    """Billion laughs and its like: refused before any expansion, also split across two chunks."""
    laughs = b'<?xml version="1.0"?>\n<!DOCTYPE nvidia_smi_log [\n <!ENTITY lol "lol">\n'
    laughs += b"".join(
        b' <!ENTITY lol%d "%s">\n' % (n, (b"&lol%d;" % (n - 1) if n > 1 else b"&lol;") * 10) for n in range(1, 10)
    )
    laughs += b"]>\n<nvidia_smi_log><gpu><product_name>&lol9;</product_name></gpu></nvidia_smi_log>"
    at = laughs.index(b"<!ENTITY") + cut
    with pytest.raises(SmiReportError, match="declares XML entities"):
        parse_output([laughs[:at], laughs[at:]])


def test_an_unknown_entity_is_not_xml() -> None:
    with pytest.raises(SmiReportError, match="undefined entity"):
        read_report(b"<nvidia_smi_log><gpu><uuid>&x;</uuid></gpu></nvidia_smi_log>")


def test_a_preamble_longer_than_looked_through_fails_as_not_xml() -> None:
    """The start of the document is looked for in the first MAX_PREAMBLE bytes only."""
    data = b"w" * (stream.MAX_PREAMBLE + 100) + (FIXTURES / "plain-v11.xml").read_bytes()
    parser = ReportParser()
    with pytest.raises(SmiReportError, match="the output is not XML"):
        # an expat that defers reparsing a long token (Debian 12's libexpat1) says so at the close
        parser.feed(data)
        parser.close()


def test_process_fields_read_as_from_the_whole_tree() -> None:
    """A field missing, repeated, with markup or space inside: read as the whole tree's elements read."""
    data = (
        b"<nvidia_smi_log><gpu><uuid>GPU-1</uuid><processes>"
        b"<process_info><pid> 10 </pid><pid>11</pid><used_memory>5 <b>MiB</b></used_memory></process_info>"
        b"<process_info><pid>12</pid><type>G</type><used_memory>N/A</used_memory>"
        b"<gpu_instance_id>1</gpu_instance_id><compute_instance_id>0</compute_instance_id></process_info>"
        b"<process_info><pid>13</pid><type>C+G</type><extra><pid>99</pid></extra></process_info>"
        b"</processes></gpu></nvidia_smi_log>"
    )
    kept, _ = read_report(data)
    assert kept.find("gpu/processes").entries == [
        ("10", None, "5 MiB", None, None),
        ("12", "G", "N/A", "1", "0"),
        ("13", "C+G", None, None, None),
    ]
    assert _everything(kept) == _everything(ET.fromstring(data))
