"""The nvidia-smi report parser on small documents made for each variation."""

from __future__ import annotations

import re
from pathlib import Path
from xml.sax.saxutils import escape

import pytest
from hypothesis import given
from hypothesis import strategies as st

from atopgpud_tw.readers.smi.mig import MigSlot, fallback_profile, mig_slots, name_slots, parse_mig_names
from atopgpud_tw.readers.smi.report import parse_report, read_devices, read_report
from atopgpud_tw.readers.smi.values import SmiReportError
from atopgpud_tw.snapshot import TASK_COMPUTE, TASK_GRAPHICS, UNSUPPORTED, DeviceSample, ProcessSample

FIXTURES = Path(__file__).parent / "fixtures" / "smi"
MIB = 1024


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def by_pid(device: DeviceSample) -> dict[int, ProcessSample]:
    return {process.pid: process for process in device.processes}


def test_plain_report_gives_identity_memory_and_busy() -> None:
    """A v11 report: key from the UUID, bus id from <gpu id>, MiB in KiB, percentages clamped."""
    devices, problems = parse_report(fixture("plain-v11.xml"))
    assert problems == {}
    first, second = devices
    assert first.key == "GPU-aaaaaaaa-0000-0000-0000-000000000001"
    assert first.busid == "00000000:17:00.0"
    assert first.name == "NVIDIA Test Board A"
    assert first.task_support == TASK_COMPUTE | TASK_GRAPHICS
    assert (first.memory_total_kib, first.memory_used_kib) == (16384 * MIB, 1000 * MIB)
    assert (first.gpu_busy, first.mem_busy) == (13, 100)
    assert first.present
    assert (second.busid, second.gpu_busy, second.mem_busy) == ("00000000:65:00.0", 0, 0)


def test_same_pid_twice_on_one_gpu_is_merged() -> None:
    """A pid listed as C and as G is one C+G process with the larger memory."""
    first, _ = parse_report(fixture("plain-v11.xml"))[0]
    assert by_pid(first)[100] == ProcessSample(100, "C+G", 500 * MIB, UNSUPPORTED, UNSUPPORTED)


def test_process_kinds_and_names() -> None:
    """G stays G, an unknown type counts as C, an empty process name is no trouble."""
    first, _ = parse_report(fixture("plain-v11.xml"))[0]
    processes = by_pid(first)
    assert sorted(processes) == [100, 200, 300]
    assert (processes[200].kind, processes[200].memory_kib) == ("G", 0)
    assert (processes[300].kind, processes[300].memory_kib) == ("C", 64 * MIB)


def test_process_busy_is_unsupported() -> None:
    """-q -x has no per-process utilization."""
    first, _ = parse_report(fixture("plain-v11.xml"))[0]
    assert {(p.gpu_busy, p.mem_busy) for p in first.processes} == {(UNSUPPORTED, UNSUPPORTED)}


def test_self_closing_processes_is_an_empty_list() -> None:
    """<processes /> means no process, not an unreadable list."""
    _, second = parse_report(fixture("plain-v11.xml"))[0]
    assert second.processes == ()


def test_v9_report_without_uuid_or_gpu_id() -> None:
    """Without <uuid> the key is the bus id, taken from <pci_bus_id> when <gpu> has no id."""
    (device,), problems = parse_report(fixture("v9-no-uuid.xml"))
    assert problems == {}
    assert device.key == device.busid == "00000000:04:00.0"
    assert (device.name, device.gpu_busy, device.mem_busy) == ("Tesla K80", 45, 20)
    assert device.processes == (ProcessSample(4242, "C", 2000 * MIB, UNSUPPORTED, UNSUPPORTED),)


def test_crlf_without_doctype_or_declaration() -> None:
    """CRLF line ends, no XML declaration, no DOCTYPE, whitespace-only <processes>."""
    data = fixture("no-doctype-crlf.xml")
    assert b"\r\n" in data and b"DOCTYPE" not in data  # the fixture is what it claims
    (device,), problems = parse_report(data)
    assert problems == {}
    assert (device.key, device.busid) == ("GPU-cccccccc-0000-0000-0000-000000000003", "00000000:01:00.0")
    assert (device.gpu_busy, device.mem_busy) == (7, 100)
    assert (device.memory_total_kib, device.memory_used_kib) == (4096 * MIB, 512 * MIB)
    assert device.processes == ()


def test_not_available_values_are_permanent() -> None:
    """N/A, Not Supported and Insufficient Permissions: -1 percentages, 0 memory, no problem."""
    (wddm, locked), problems = parse_report(fixture("not-available.xml"))
    assert problems == {}
    assert (wddm.gpu_busy, wddm.mem_busy) == (UNSUPPORTED, UNSUPPORTED)
    assert (wddm.memory_total_kib, wddm.memory_used_kib) == (8192 * MIB, 0)
    assert (locked.gpu_busy, locked.mem_busy) == (UNSUPPORTED, UNSUPPORTED)
    assert (locked.memory_total_kib, locked.memory_used_kib) == (0, 0)
    assert locked.processes == ()


def test_wddm_process_memory_not_available_is_unknown() -> None:
    """Under WDDM every used_memory is N/A: the processes are kept, their memory -1 (not known)."""
    wddm, _ = parse_report(fixture("not-available.xml"))[0]
    assert wddm.processes == (
        ProcessSample(7724, "C+G", UNSUPPORTED, UNSUPPORTED, UNSUPPORTED),
        ProcessSample(10808, "C+G", UNSUPPORTED, UNSUPPORTED, UNSUPPORTED),
    )


def test_unreadable_values_degrade_only_themselves() -> None:
    """An unreadable value is None for this poll and a problem; the rest of the GPU is read."""
    (odd, lost_pid, fine), problems = parse_report(fixture("unreadable.xml"))
    assert (odd.gpu_busy, odd.mem_busy) == (None, 4)
    assert (odd.memory_total_kib, odd.memory_used_kib) == (24576 * MIB, None)
    assert by_pid(odd)[501].memory_kib is None
    assert by_pid(odd)[502].memory_kib == 100 * MIB
    assert lost_pid.processes is None  # a partial list would make pid 601 seem to end
    assert (lost_pid.gpu_busy, lost_pid.memory_used_kib) == (30, 300 * MIB)
    assert (fine.gpu_busy, fine.memory_used_kib, fine.processes) == (0, 1 * MIB, ())
    key = "GPU-ffffffff-0000-0000-0000-000000000006"
    assert set(problems) == {
        f"{key} utilization/gpu_util",
        f"{key} fb_memory_usage/used",
        f"{key} used_memory",
        "GPU-ffffffff-0000-0000-0000-000000000007 pid",
    }
    assert problems[f"{key} utilization/gpu_util"] == (
        "GPU 00000000:21:00.0: unreadable utilization/gpu_util 'Unknown Error'"
    )


@given(
    tag=st.sampled_from(["gpu_util", "memory_util", "total", "used", "pid", "type", "used_memory", "uuid"]),
    text=st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=20),
)
def test_any_value_degrades_only_itself(tag: str, text: str) -> None:
    """Whatever text one value holds, the report still gives both GPUs, each value in its domain."""
    pattern = re.compile(f"<{tag}>[^<]*</{tag}>".encode())
    replacement = f"<{tag}>{escape(text)}</{tag}>".encode()
    data = pattern.sub(lambda _: replacement, fixture("plain-v11.xml"), count=1)
    devices, problems = parse_report(data)
    assert len(devices) == 2
    for device in devices:
        assert device.gpu_busy is None or UNSUPPORTED <= device.gpu_busy <= 100
        assert device.memory_used_kib is None or device.memory_used_kib >= 0
        assert all(p.kind in ("C", "G", "C+G") for p in device.processes or ())
    assert all("\n" not in description for description in problems.values())


def test_garbage_raises_report_error() -> None:
    """Output that is not XML raises SmiReportError with a one-line message."""
    with pytest.raises(SmiReportError, match="not XML") as raised:
        parse_report(fixture("garbage.txt"))
    assert "\n" not in str(raised.value)


def test_other_document_raises_report_error() -> None:
    """XML with another root is not a report."""
    with pytest.raises(SmiReportError, match="<html>, not <nvidia_smi_log>"):
        parse_report(fixture("not-a-report.xml"))


@pytest.mark.parametrize("data", [b"", b"  \n", b"<nvidia_smi_log><gpu id='x'>"])
def test_empty_or_cut_output_raises_report_error(data: bytes) -> None:
    """Empty output and a document cut short are errors of the whole report."""
    with pytest.raises(SmiReportError):
        parse_report(data)


def test_warning_before_the_document_is_a_problem_not_a_failure() -> None:
    """A warning printed ahead of the XML is reported, and the report is still read."""
    data = b"WARNING: infoROM is corrupted at gpu 0000:17:00.0\n" + fixture("plain-v11.xml")
    devices, problems = parse_report(data)
    assert len(devices) == 2
    assert problems == {
        "preamble": "nvidia-smi printed before its report: WARNING: infoROM is corrupted at gpu 0000:17:00.0"
    }


def test_mig_instances_are_devices_sorted_by_index() -> None:
    """Each instance: the identity scheme's bus id and key, its own memory, no busy figures."""
    profiles = {("00000000:17:00.0", 1, 0): "3g.40gb", ("00000000:17:00.0", 5, 0): "2g.20gb"}
    devices, problems = parse_report(fixture("mig.xml"), profiles=profiles)
    assert problems == {}
    card = "GPU-11111111-2222-3333-4444-555555555555"
    assert [(d.busid, d.key, d.name) for d in devices[:3]] == [
        ("00000000:17:00.0/1.0", f"{card}/1.0", "3g.40gb"),
        ("00000000:17:00.0/5.0", f"{card}/5.0", "2g.20gb"),
        ("00000000:17:00.0/13.0", f"{card}/13.0", "14sm.10gb"),  # no profile given: derived
    ]
    assert [(d.memory_total_kib, d.memory_used_kib) for d in devices[:3]] == [
        (40192 * MIB, 1200 * MIB),
        (19968 * MIB, 10 * MIB),
        (9728 * MIB, 0),
    ]
    assert {(d.gpu_busy, d.mem_busy) for d in devices[:3]} == {(UNSUPPORTED, UNSUPPORTED)}
    assert devices[3].busid == "00000000:65:00.0"
    assert (devices[3].gpu_busy, devices[3].mem_busy) == (5, 2)


def test_mig_processes_go_to_their_own_instance() -> None:
    """A process is charged to the instance whose ids it carries, not to every instance."""
    devices, _ = parse_report(fixture("mig.xml"))
    one, five, thirteen, other = devices
    assert one.processes == (ProcessSample(1000, "C", 1100 * MIB, UNSUPPORTED, UNSUPPORTED),)
    assert five.processes == (
        ProcessSample(1000, "C", 6 * MIB, UNSUPPORTED, UNSUPPORTED),
        ProcessSample(1002, "C", 4 * MIB, UNSUPPORTED, UNSUPPORTED),
    )
    assert thirteen.processes == ()
    assert [p.pid for p in other.processes] == [2000]


def test_mig_card_mode_sums_the_instances() -> None:
    """mig="card": the card is one device with its instances' memory and processes."""
    devices, problems = parse_report(fixture("mig.xml"), mig="card")
    assert problems == {}
    card = devices[0]
    assert (card.key, card.busid, card.name) == (
        "GPU-11111111-2222-3333-4444-555555555555",
        "00000000:17:00.0",
        "NVIDIA A100-SXM4-80GB",
    )
    assert (card.memory_total_kib, card.memory_used_kib) == ((40192 + 19968 + 9728) * MIB, 1210 * MIB)
    assert (card.gpu_busy, card.mem_busy) == (UNSUPPORTED, UNSUPPORTED)
    # pid 1000 holds memory on two instances: both count
    assert card.processes == (
        ProcessSample(1000, "C", 1106 * MIB, UNSUPPORTED, UNSUPPORTED),
        ProcessSample(1002, "C", 4 * MIB, UNSUPPORTED, UNSUPPORTED),
    )
    assert len(devices) == 2


def test_mig_card_without_instances_is_the_card_and_a_problem() -> None:
    """MIG enabled with nothing carved: the card itself, no busy figures, and a problem."""
    (card,), problems = parse_report(fixture("mig-empty.xml"))
    assert (card.busid, card.name) == ("00000000:17:00.0", "NVIDIA A100-SXM4-80GB")
    assert (card.memory_total_kib, card.memory_used_kib) == (81920 * MIB, 0)
    assert (card.gpu_busy, card.mem_busy) == (UNSUPPORTED, UNSUPPORTED)
    assert problems == {
        "00000000:17:00.0 mig-empty": (
            "GPU 00000000:17:00.0 is in MIG mode with no instances: nothing can run on it"
        )
    }


def test_process_on_no_listed_instance_is_a_problem() -> None:
    """A process whose instance ids match no instance is left out, and said so."""
    head, processes = fixture("mig.xml").split(b"<processes>", 1)
    data = head + b"<processes>" + processes.replace(b"<gpu_instance_id>5<", b"<gpu_instance_id>7<")
    devices, problems = parse_report(data)
    assert [p.pid for p in devices[0].processes] == [1000]
    assert problems == {
        "GPU-11111111-2222-3333-4444-555555555555 mig-unmatched": (
            "GPU 00000000:17:00.0: processes on no listed MIG instance are left out (pids [1000, 1002])"
        )
    }


def test_unknown_mig_mode_is_refused() -> None:
    """A misspelt mode is a programming error, not a silent default."""
    with pytest.raises(ValueError, match="instances, card"):
        parse_report(fixture("mig.xml"), mig="instance")


def test_fallback_profile_says_what_the_report_states() -> None:
    """SMs and memory rounded up to GiB; what is missing is left out."""
    slot = MigSlot("k", "b", 0, 1, 0, 42, 19968 * MIB)
    assert fallback_profile(slot) == "42sm.20gb"
    assert fallback_profile(slot._replace(multiprocessors=None)) == "20gb"
    assert fallback_profile(slot._replace(multiprocessors=None, memory_total_kib=0)) == "MIG"


def test_parse_mig_names_by_card_uuid_and_device() -> None:
    """-L gives profiles per (card UUID, Device N); cards without MIG lines give none."""
    names = parse_mig_names((FIXTURES / "mig-list.txt").read_text())
    card = "GPU-11111111-2222-3333-4444-555555555555"
    assert {key: profile for key, (profile, _) in names.items()} == {
        (card, 0): "3g.40gb", (card, 1): "2g.20gb", (card, 2): "1g.10gb"
    }


def test_parse_mig_names_old_driver_and_compute_instances() -> None:
    """R450-style MIG UUIDs and compute-instance profiles (1c.3g.40gb) are read alike."""
    text = (
        "GPU 0: A100-SXM4-40GB (UUID: GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77)\r\n"
        "  MIG 1c.3g.20gb Device 0: (UUID: MIG-GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77/1/0)\r\n"
        "  MIG 1c.3g.20gb Device 1: (UUID: MIG-GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77/1/1)\r\n"
    )
    card = "GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77"
    assert parse_mig_names(text) == {
        (card, 0): ("1c.3g.20gb", f"MIG-{card}/1/0"), (card, 1): ("1c.3g.20gb", f"MIG-{card}/1/1")
    }


def test_name_slots_maps_devices_to_instance_ids() -> None:
    """-L's Device N becomes the profile of the instance whose <index> is N."""
    root, _ = read_report(fixture("mig.xml"))
    names = parse_mig_names((FIXTURES / "mig-list.txt").read_text())
    profiles, _ = name_slots(mig_slots(root), names)
    assert profiles == {
        ("00000000:17:00.0", 1, 0): "3g.40gb",
        ("00000000:17:00.0", 5, 0): "2g.20gb",
        ("00000000:17:00.0", 13, 0): "1g.10gb",
    }


def test_name_slots_refuses_a_listing_of_other_instances() -> None:
    """When -L and -q -x disagree (reconfigured in between) no name is guessed."""
    root, _ = read_report(fixture("mig.xml"))
    names = {("GPU-11111111-2222-3333-4444-555555555555", 0): ("7g.80gb", "")}
    expected = r"lists MIG devices \[0\] of GPU 00000000:17:00.0, the report \[0, 1, 2\]"
    with pytest.raises(SmiReportError, match=expected):
        name_slots(mig_slots(root), names)


def test_mig_slots_lists_only_cards_in_mig_mode() -> None:
    """The slots are what -L names are matched against: ids, SMs and memory per instance."""
    root, _ = read_report(fixture("mig.xml"))
    card = "GPU-11111111-2222-3333-4444-555555555555"
    assert mig_slots(root) == (
        MigSlot(card, "00000000:17:00.0", 0, 1, 0, 42, 40192 * MIB),
        MigSlot(card, "00000000:17:00.0", 1, 5, 0, 28, 19968 * MIB),
        MigSlot(card, "00000000:17:00.0", 2, 13, 0, 14, 9728 * MIB),
    )


@pytest.mark.parametrize(
    ("old", "new", "cause", "said"),
    [
        (b"<used>1000 MiB<", b"<used>20000 MiB<", "used", "implausible fb_memory_usage/used 20000 MiB, more than"),
        (b"<total>16384 MiB<", b"<total>" + b"9" * 30 + b" MiB<", "total", "implausible fb_memory_usage/total"),
        # beyond 256 characters a text is cut (stream.MAX_TEXT), and what is left has no unit
        (b"<used>1000 MiB<", b"<used>" + b"9" * 4000 + b" MiB<", "used", "unreadable fb_memory_usage/used '999"),
        (b"<used>1000 MiB<", b"<used>-5 MiB<", "used", "unreadable fb_memory_usage/used '-5 MiB'"),
        (b"<gpu_util>12.6 %<", b"<gpu_util>" + b"9" * 400 + b" %<", "gpu_util", "unreadable utilization/gpu_util"),
    ],
)
def test_implausible_memory_is_a_failed_reading(old: bytes, new: bytes, cause: str, said: str) -> None:
    """Absurd sizes, negative ones and more used than total fail that one value, with one short line."""
    data = fixture("plain-v11.xml").replace(old, new, 1)
    assert data != fixture("plain-v11.xml")
    (first, second), problems = parse_report(data)
    field = {"used": "memory_used_kib", "total": "memory_total_kib", "gpu_util": "gpu_busy"}[cause]
    assert getattr(first, field) is None
    assert second.memory_used_kib == 5 * MIB  # the other card is read as before
    (problem,) = (text for text in problems.values() if "longer than" not in text)
    assert said in problem and len(problem) < 200


def test_a_thousand_digit_pid_drops_only_that_process_list() -> None:
    """A pid no system has is unreadable, not an error out of the parser."""
    data = fixture("plain-v11.xml").replace(b"<pid>300<", b"<pid>" + b"7" * 5000 + b"<", 1)
    (first, second), problems = parse_report(data)
    assert first.processes is None
    assert any("unreadable pid" in problem for problem in problems.values())


def test_process_start_times_come_from_what_the_reader_gives() -> None:
    """Each listed pid carries the start time `starts` gives it (the reader's: /proc), which tells a
    reused pid from the process that had it; without `starts` none is known."""
    root, _ = read_report(fixture("plain-v11.xml"))
    (first, _), _ = read_devices(root, starts=lambda pid: pid * 10 if pid != 200 else None)
    assert {p.pid: p.started for p in first.processes} == {100: 1000, 200: None, 300: 3000}
    (first, _), _ = read_devices(root)
    assert {p.started for p in first.processes} == {None}
