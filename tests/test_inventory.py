"""Inventory that joins: ``atopgpud_gpu_info``, and the ``uuid`` label on every per-GPU series.

Both readers: NVML on the simulator (cards, MIG instances, a board without a
serial), nvidia-smi from its reports (tests/fixtures/smi); one installed daemon
scraped whole.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from daemon import free_port, run_daemon, smi_stand_in
from metrics_text import FakePoller, samples_of, series
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sim_readers import make_reader, poll

from atopgpud_tw.readers.nvml.health import read_card_health
from atopgpud_tw.readers.smi.health import read_cards_health
from atopgpud_tw.readers.smi.mig import mig_slots, name_slots, parse_mig_names
from atopgpud_tw.readers.smi.report import read_devices
from atopgpud_tw.readers.smi.stream import read_report
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.web.metrics import BoardCollector
from atopgpud_tw.snapshot import DeviceInfo

FIXTURES = Path(__file__).parent / "fixtures" / "smi"
CARD_UUID = "GPU-5111a7ed-0000-4000-8000-0000000000a1"
SCENARIO = {
    "gpus": [
        {
            "name": "NVIDIA A100-SXM4-80GB",
            "busid": "00000000:17:00.0",
            "uuid": CARD_UUID,
            "serial": "1324321002473",
            "vbios": "92.00.45.00.03",
            "memory_total_mib": 81920,
            "mig": [
                {"profile": "3g.40gb", "gpu_instance": 1, "compute_instance": 0, "memory_total_mib": 40192},
                {"profile": "2g.20gb", "gpu_instance": 5, "compute_instance": 0, "memory_total_mib": 19968},
            ],
        },
        {"name": "NVIDIA GeForce RTX 4090", "busid": "00000000:65:00.0", "serial": None,
         "processes": [{"pid": 4242, "memory_mib": 100, "sm_util": 20, "mem_util": 4}]},
    ]
}
#: the labels every per-GPU family carries
GPU_KEYS = {"busid", "uuid"}


def test_nvml_reads_what_each_device_is_once():
    """UUID, serial, VBIOS, driver and CUDA versions at discovery; MIG instances their own MIG- UUID."""
    clock = [0.0]
    reader, nvml = make_reader(SCENARIO, clock)
    for second in range(3):
        snapshot, problems = poll(reader, clock, float(second))
        assert problems == {}
    first, second, whole = (device.info for device in snapshot.devices)
    assert first == DeviceInfo(
        uuid="MIG-5111a7ed-0000-4000-8000-000000001000", serial="1324321002473", vbios="92.00.45.00.03",
        driver_version="999.99.99-sim", cuda_version="12.8", mig_profile="3g.40gb",
        parent_uuid=CARD_UUID, gpu_instance="1", compute_instance="0",
    )
    assert second.uuid == "MIG-5111a7ed-0000-4000-8000-000000005000" and second.mig_profile == "2g.20gb"
    assert (second.parent_uuid, second.gpu_instance, second.compute_instance) == (CARD_UUID, "5", "0")
    # GeForce boards have no serial: an empty label, not a missing series
    assert whole == DeviceInfo(uuid="GPU-5111a7ed-0000-4000-8000-000000000001", serial="",
                               vbios="96.00.5E.00.01", driver_version="999.99.99-sim", cuda_version="12.8")
    # read once, not per poll
    assert nvml.calls["nvmlDeviceGetSerial"] == 2
    assert nvml.calls["nvmlDeviceGetVbiosVersion"] == 2
    assert nvml.calls["nvmlSystemGetDriverVersion"] == 1
    # the cards' UUIDs and the instances' (as labels) once, at start-up; after that each
    # instance's once a poll, which tells that its handle is still the instance it was
    # (docs/mig.md), 3 polls of 2 instances; the label itself is not read again
    assert nvml.calls["nvmlDeviceGetUUID"] == 2 + 2 + 3 * 2
    assert read_card_health(reader._devices[0]).uuid == CARD_UUID


def test_the_daemons_older_driver_reports_its_cuda_version():
    """The CUDA version follows the simulated driver branch."""
    clock = [0.0]
    reader, _ = make_reader({"driver": "470", "gpus": [{"name": "NVIDIA A10"}]}, clock)
    snapshot, _ = poll(reader, clock, 0.0)
    assert (snapshot.devices[0].info.driver_version, snapshot.devices[0].info.cuda_version) == ("470.256.02", "11.4")


def page_from_nvml(processes: bool = True) -> dict:
    clock = [0.0]
    reader, _ = make_reader(SCENARIO, clock)
    board = Board()
    for second in range(3):
        board.fold(poll(reader, clock, float(second))[0])
    return samples_of(generate_latest(BoardCollector(board, FakePoller(), 0.5, processes)).decode())


def test_gpu_info_series_has_every_label():
    """One atopgpud_gpu_info per device, value 1, with the inventory as labels."""
    page = page_from_nvml()
    infos = {labels: value for (name, labels), value in page.items() if name == "atopgpud_gpu_info"}
    assert set(infos.values()) == {1}
    assert {dict(labels)["uuid"]: dict(labels) for labels in infos}["MIG-5111a7ed-0000-4000-8000-000000001000"] == {
        "index": "0", "busid": "00000000:17:00.0/1.0", "uuid": "MIG-5111a7ed-0000-4000-8000-000000001000",
        "name": "3g.40gb", "serial": "1324321002473", "driver_version": "999.99.99-sim",
        "cuda_driver_version": "12.8", "vbios": "92.00.45.00.03", "mig_profile": "3g.40gb",
    }
    (card,) = [dict(labels) for labels in infos if dict(labels)["busid"] == "00000000:65:00.0"]
    assert card["serial"] == "" and card["mig_profile"] == "" and card["name"] == "NVIDIA GeForce RTX 4090"
    assert series(page, "atopgpud_process_samples_total", pid="4242",
                  uuid="GPU-5111a7ed-0000-4000-8000-000000000001") == [3]


def test_every_per_gpu_family_carries_the_uuid():
    """Every series with a bus id has the device's UUID too, the same one as its info series."""
    page = page_from_nvml()
    uuids = {dict(labels)["busid"]: dict(labels)["uuid"] for (name, labels), _ in page.items()
             if name == "atopgpud_gpu_info"}
    seen = set()
    for (name, labels), _ in page.items():
        keys = dict(labels)
        if "busid" in keys:
            seen.add(name)
            assert keys.get("uuid") == uuids[keys["busid"]], name
    assert {"atopgpud_gpu_busy_percent_seconds_total", "atopgpud_gpu_present", "atopgpud_process_samples_total",
            "atopgpud_gpu_memory_used_bytes"} <= seen


def test_smi_reads_the_inventory_from_the_report():
    """<uuid>, <serial>, <vbios_version>, <driver_version> and <cuda_version>; what a report lacks is empty."""
    root, _ = read_report((FIXTURES / "agree-mixed-host.xml").read_bytes())
    devices, _ = read_devices(root)
    *instances, whole = devices
    assert whole.info == DeviceInfo(uuid=whole.info.uuid, serial="1652923030001", vbios="96.00.A5.00.01",
                                    driver_version="570.86.15", cuda_version="12.8")
    assert whole.info.uuid.startswith("GPU-")
    assert instances and all(device.info.mig_profile == device.name for device in instances)
    assert all(device.info.serial == "1652923030000" and device.info.cuda_version == "12.8" for device in instances)
    # -q -x names no MIG device UUID: empty, the series still there
    assert all(device.info.uuid == "" for device in instances)
    # a v11 report without serial or VBIOS: empty labels
    root, _ = read_report((FIXTURES / "plain-v11.xml").read_bytes())
    devices, _ = read_devices(root)
    assert devices[0].info == DeviceInfo(uuid="GPU-aaaaaaaa-0000-0000-0000-000000000001",
                                         driver_version="525.60.13", cuda_version="12.0")
    health = read_cards_health(root)
    assert [reading.uuid for reading in health] == [device.info.uuid for device in devices]


def test_smi_mig_instances_carry_the_uuids_nvidia_smi_l_lists():
    """``nvidia-smi -L`` names each MIG device's UUID; matched by card UUID and device index, as the profiles."""
    root, _ = read_report((FIXTURES / "mig.xml").read_bytes())
    listing = (FIXTURES / "mig-list.txt").read_text()
    slots = mig_slots(root)
    profiles, uuids = name_slots(slots, parse_mig_names(listing))
    devices, _ = read_devices(root, "instances", profiles, None, uuids)
    instances = [device for device in devices if "/" in device.busid]
    assert [device.info.uuid for device in instances] == [
        "MIG-0e3e4b6d-1c0a-5d2e-9f3c-111111111111", "MIG-0e3e4b6d-1c0a-5d2e-9f3c-222222222222",
        "MIG-0e3e4b6d-1c0a-5d2e-9f3c-333333333333",
    ]
    assert [device.info.mig_profile for device in instances] == ["3g.40gb", "2g.20gb", "1g.10gb"]


@pytest.mark.e2e
def test_the_nvidia_smi_daemons_page_carries_mig_uuids(tmp_path):
    """--reader nvidia-smi on a MIG report: gpu_info and the instances' series carry the MIG- UUIDs of -L."""
    port = free_port()
    binary = smi_stand_in(tmp_path, FIXTURES / "mig.xml", FIXTURES / "mig-list.txt")
    args = ["--reader", "nvidia-smi", "--nvidia-smi", str(binary), "--interval", "0.5",
            "--metrics", f"tcp:{port}:interface=127.0.0.1"]
    with run_daemon(tmp_path, args) as daemon:
        daemon.wait_samples(1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            page = samples_of(response.read().decode())
    assert series(page, "atopgpud_gpu_present", uuid="MIG-0e3e4b6d-1c0a-5d2e-9f3c-222222222222") == [1]
    (info,) = [dict(labels) for (name, labels), _ in page.items()
               if name == "atopgpud_gpu_info" and dict(labels)["uuid"].endswith("111111111111")]
    assert info["mig_profile"] == "3g.40gb" and info["busid"].startswith("00000000:")
    health_uuids = {dict(labels)["uuid"] for (name, labels), _ in page.items()
                    if name == "atopgpud_gpu_health_stale"}
    assert "GPU-11111111-2222-3333-4444-555555555555" in health_uuids


def test_smi_na_is_an_empty_label():
    root, _ = read_report((FIXTURES / "not-available.xml").read_bytes())
    devices, _ = read_devices(root)
    assert devices and all("N/A" not in str(device.info) for device in devices)


@pytest.mark.e2e
def test_the_daemons_page_joins_by_uuid(tmp_path):
    """The installed daemon: every per-GPU family of the page, health ones included, carries a UUID."""
    port = free_port()
    args = ["--interval", "0.2", "--metrics", f"tcp:{port}:interface=127.0.0.1", "--metrics-processes"]
    with run_daemon(tmp_path, args, scenario=SCENARIO) as daemon:
        daemon.wait_samples(2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    families = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "busid" in sample.labels:
                families.setdefault(family.name, set()).add(sample.labels.get("uuid"))
    assert "atopgpud_gpu_info" in families and "atopgpud_gpu_temperature_celsius" in families
    for name, uuids in families.items():
        assert uuids and all(uuid and uuid.startswith(("GPU-", "MIG-")) for uuid in uuids), name
    assert "MIG-5111a7ed-0000-4000-8000-000000001000" in families["atopgpud_gpu_present"]


SHARED = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "nvidia-smi"


def test_a_real_capture_gives_the_inventory():
    """A real A100 report in MIG mode (shared corpus): the elements are where the reader looks."""
    report = SHARED / "a100-sxm4-40gb-510.47.03-mig.xml"
    if not report.is_file():
        pytest.skip(f"{report} is absent (the shared corpus of real reports)")
    root, _ = read_report(report.read_bytes())
    devices, _ = read_devices(root)
    assert devices and all(device.info.driver_version == "510.47.03" for device in devices)
    assert {device.info.serial for device in devices} == {"1324321002473"}
    assert {device.info.vbios for device in devices} == {"92.00.45.00.03"}
    assert {device.info.cuda_version for device in devices} == {"11.6"}
    assert {reading.uuid for reading in read_cards_health(root)} == {"GPU-27b94a00-ed54-5c24-b1fd-1054085de32a"}


def test_a_reinitialised_driver_is_asked_again_what_the_cards_are():
    """Read once per discovery, not per poll; a driver set up again (perhaps a new version) is asked again."""
    from sim_readers import ScenarioRun, scenario_gpu

    fault = {"call": "*", "error": "NVML_ERROR_UNINITIALIZED", "from": 5, "until": 7}
    run = ScenarioRun({"gpus": [scenario_gpu(0), scenario_gpu(1)], "faults": [fault]}, report=True, contain=False)
    run.until(4)
    assert run.nvml.nvmlLib.calls["nvmlDeviceGetSerial"] == 2
    run.until(30)
    assert run.nvml.nvmlLib.calls["nvmlDeviceGetSerial"] == 4
    assert all(device.info.driver_version == "999.99.99-sim" and device.info.uuid.startswith("GPU-")
               for device in run.board.counters.devices)
