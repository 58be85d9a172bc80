"""What fleets join on: ``atopgpud_mig_info`` (a MIG instance's card, GPU and compute instance ids)
and the free and reserved memory beside the used and total, from both readers.

NVML on the simulator (v2 memory on a current driver, v1 on 470), nvidia-smi from
its reports (tests/fixtures/smi), each page built as the daemon builds it.
"""

from __future__ import annotations

from pathlib import Path

from metrics_text import FakePoller, samples_of, series
from prometheus_client.exposition import generate_latest
from sim_readers import make_reader, poll

from atopgpud_tw.readers.smi.mig import mig_slots, name_slots, parse_mig_names
from atopgpud_tw.readers.smi.report import read_devices
from atopgpud_tw.readers.smi.stream import read_report
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.web.metrics import BoardCollector
from atopgpud_tw.snapshot import DeviceSample, Snapshot

FIXTURES = Path(__file__).parent / "fixtures" / "smi"
MIB = 1048576
CARD_UUID = "GPU-5111a7ed-0000-4000-8000-0000000000a1"
PLAIN_UUID = "GPU-5111a7ed-0000-4000-8000-000000000001"


def scenario(driver: str | None = None) -> dict:
    found: dict = {
        "gpus": [
            {
                "name": "NVIDIA A100-SXM4-80GB", "busid": "00000000:17:00.0", "uuid": CARD_UUID,
                "memory_total_mib": 81920, "memory_reserved_mib": 651,
                "mig": [
                    {"profile": "3g.40gb", "gpu_instance": 1, "compute_instance": 0, "memory_total_mib": 40192},
                    {"profile": "2g.20gb", "gpu_instance": 5, "compute_instance": 0, "memory_total_mib": 19968},
                ],
            },
            {"name": "NVIDIA L40S", "busid": "00000000:65:00.0", "uuid": PLAIN_UUID, "memory_total_mib": 46068,
             "memory_used_mib": 1000, "memory_reserved_mib": 300},
        ]
    }
    if driver:
        found["driver"] = driver
    return found


def page_of(samples: list[tuple[DeviceSample, ...]]) -> dict:
    board = Board()
    for devices in samples:
        board.fold(Snapshot(devices=tuple(devices)))
    return samples_of(generate_latest(BoardCollector(board, FakePoller(), 0.5, False)).decode())


def nvml_page(driver: str | None = None, mig: str = "instances") -> dict:
    clock = [0.0]
    reader, _ = make_reader(scenario(driver), clock, mig=mig)
    board = Board()
    for second in range(2):
        board.fold(poll(reader, clock, float(second))[0])
    return samples_of(generate_latest(BoardCollector(board, FakePoller(), 0.5, False)).decode())


def infos(page: dict) -> dict[str, dict[str, str]]:
    return {dict(labels)["uuid"]: dict(labels) for (name, labels), value in page.items()
            if name == "atopgpud_mig_info" and value == 1}


def test_nvml_mig_instances_have_an_info_series_with_their_card_and_ids():
    """One atopgpud_mig_info per MIG instance (none for a whole card), joined on the instance's uuid."""
    page = nvml_page()
    found = infos(page)
    assert found["MIG-5111a7ed-0000-4000-8000-000000001000"] == {
        "index": "0", "busid": "00000000:17:00.0/1.0", "uuid": "MIG-5111a7ed-0000-4000-8000-000000001000",
        "parent_uuid": CARD_UUID, "gpu_instance": "1", "compute_instance": "0", "mig_profile": "3g.40gb",
    }
    assert found["MIG-5111a7ed-0000-4000-8000-000000005000"]["gpu_instance"] == "5"
    assert set(found) == {"MIG-5111a7ed-0000-4000-8000-000000001000", "MIG-5111a7ed-0000-4000-8000-000000005000"}
    # the instance's other series keep their identity: no new labels on them
    (labels,) = [dict(labels) for (name, labels), _ in page.items()
                 if name == "atopgpud_gpu_present" and dict(labels)["busid"].endswith("/1.0")]
    assert set(labels) == {"index", "busid", "type", "uuid"}


def test_nvml_v2_memory_has_free_and_reserved():
    """Through the v2 structure: free and reserved as the driver has them, total = used + free + reserved;
    a MIG instance reserves nothing of its own."""
    page = nvml_page()
    used = series(page, "atopgpud_gpu_memory_used_bytes", uuid=PLAIN_UUID)
    free = series(page, "atopgpud_gpu_memory_free_bytes", uuid=PLAIN_UUID)
    reserved = series(page, "atopgpud_gpu_memory_reserved_bytes", uuid=PLAIN_UUID)
    total = series(page, "atopgpud_gpu_memory_total_bytes", uuid=PLAIN_UUID)
    assert reserved == [300 * MIB] and used == [1000 * MIB]
    assert free == [total[0] - used[0] - reserved[0]]
    instance = "MIG-5111a7ed-0000-4000-8000-000000001000"
    assert series(page, "atopgpud_gpu_memory_reserved_bytes", uuid=instance) == [0]
    assert series(page, "atopgpud_gpu_memory_free_bytes", uuid=instance) == [40192 * MIB]


def test_nvml_v1_memory_has_free_and_no_reserved():
    """A driver before 510 (v1 only): free is read, reserved is not there (v1's used counts it)."""
    page = nvml_page(driver="470")
    total = series(page, "atopgpud_gpu_memory_total_bytes", uuid=PLAIN_UUID)[0]
    used = series(page, "atopgpud_gpu_memory_used_bytes", uuid=PLAIN_UUID)[0]
    assert used == 1300 * MIB
    assert series(page, "atopgpud_gpu_memory_free_bytes", uuid=PLAIN_UUID) == [total - used]
    assert series(page, "atopgpud_gpu_memory_reserved_bytes", uuid=PLAIN_UUID) == []


def test_nvml_mig_card_sums_the_instances_free_and_reserved():
    """--mig card: the card's free and reserved are its instances' summed."""
    page = nvml_page(mig="card")
    assert series(page, "atopgpud_gpu_memory_free_bytes", uuid=CARD_UUID) == [(40192 + 19968) * MIB]
    assert series(page, "atopgpud_gpu_memory_reserved_bytes", uuid=CARD_UUID) == [0]
    assert infos(page) == {}


def smi_devices(mig: str = "instances") -> tuple[DeviceSample, ...]:
    root, _ = read_report((FIXTURES / "mig.xml").read_bytes())
    listing = (FIXTURES / "mig-list.txt").read_text()
    slots = mig_slots(root)
    profiles, uuids = name_slots(slots, parse_mig_names(listing))
    devices, problems = read_devices(root, mig, profiles, None, uuids)
    assert not problems
    return devices


def test_smi_reads_free_and_reserved_of_cards_and_instances():
    """FB Memory Usage's Free and Reserved, of a whole card and of each MIG device; a report without them
    (before 510's schema) has no such series."""
    root, _ = read_report((FIXTURES / "plain-v11.xml").read_bytes())
    devices, _ = read_devices(root)
    assert [(d.memory_free_kib, d.memory_reserved_kib) for d in devices] == [
        (15084 * 1024, 300 * 1024), (7987 * 1024, 200 * 1024)
    ]
    page = page_of([devices])
    assert series(page, "atopgpud_gpu_memory_reserved_bytes", uuid=devices[0].info.uuid) == [300 * MIB]
    assert series(page, "atopgpud_gpu_memory_free_bytes", uuid=devices[0].info.uuid) == [15084 * MIB]
    instances = [device for device in smi_devices() if "/" in device.busid]
    assert [(d.memory_free_kib, d.memory_reserved_kib) for d in instances] == [
        (38992 * 1024, 0), (19958 * 1024, 0), (9728 * 1024, 0)
    ]
    # an older schema (v9): free but no reserved (its used counts it)
    root, _ = read_report((FIXTURES / "v9-no-uuid.xml").read_bytes())
    devices, _ = read_devices(root)
    assert (devices[0].memory_free_kib, devices[0].memory_reserved_kib) == (9391 * 1024, None)
    page = page_of([devices])
    assert not any(name == "atopgpud_gpu_memory_reserved_bytes" for name, _ in page)
    assert series(page, "atopgpud_gpu_memory_free_bytes") == [9391 * MIB]


def test_smi_mig_instances_have_an_info_series_with_their_card_and_ids():
    """The nvidia-smi reader: each MIG device's card UUID, GPU and compute instance ids from -q -x,
    its own UUID from -L."""
    found = infos(page_of([smi_devices()]))
    assert found["MIG-0e3e4b6d-1c0a-5d2e-9f3c-111111111111"] | {"index": ""} == {
        "index": "", "busid": "00000000:17:00.0/1.0", "uuid": "MIG-0e3e4b6d-1c0a-5d2e-9f3c-111111111111",
        "parent_uuid": "GPU-11111111-2222-3333-4444-555555555555", "gpu_instance": "1", "compute_instance": "0",
        "mig_profile": "3g.40gb",
    }
    assert sorted(labels["gpu_instance"] for labels in found.values()) == ["1", "13", "5"]
