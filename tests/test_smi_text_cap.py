"""nvidia-smi's text fields capped: a huge product name, UUID or version is cut to MAX_TEXT
characters with one trouble for the poll, and the daemon's /metrics page and log stay small."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from daemon import free_port, run_daemon, smi_stand_in

from atopgpud_tw.readers.smi.report import parse_report
from atopgpud_tw.readers.smi.values import MAX_TEXT

FIXTURE = Path(__file__).with_name("fixtures") / "smi" / "health-v13.xml"
NAME = "NVIDIA H100 80GB HBM3"


def with_long_texts(size: int) -> bytes:
    """The health fixture with a product name and a driver version `size` characters long."""
    report = FIXTURE.read_text()
    report = report.replace(f"<product_name>{NAME}</product_name>",
                            f"<product_name>{NAME}{'x' * size}</product_name>", 1)
    start = report.index("<driver_version>") + len("<driver_version>")
    return (report[:start] + "9" * size + report[start:]).encode()


def test_a_huge_product_name_is_cut_with_one_trouble():
    """A 1,000,000-character product name: the device's name is its first MAX_TEXT characters,
    and the poll has one trouble naming the field; so has the driver version."""
    devices, problems = parse_report(with_long_texts(1_000_000))
    assert MAX_TEXT == 256
    name = devices[0].name
    assert len(name) == MAX_TEXT and name.startswith(NAME + "xxx") and name.endswith("xxx")
    assert "\u2026" in name  # an ellipsis says where it is cut
    assert len(devices[0].info.driver_version) == MAX_TEXT
    said = [text for text in problems.values() if "longer than" in text]
    assert len(said) == 2 and any("product_name" in text for text in said), said


def test_a_process_field_of_a_million_digits_is_cut():
    """A pid a million digits long is unreadable (its list dropped for the poll), and never kept whole."""
    report = FIXTURE.with_name("clones.xml").read_text()
    start = report.index("<pid>", report.index("<process_info>")) + len("<pid>")
    devices, problems = parse_report((report[:start] + "1" * 1_000_000 + report[start:]).encode())
    assert any("unreadable pid" in text for text in problems.values())


@pytest.mark.e2e
def test_the_daemon_serves_a_small_page_and_logs_a_line(tmp_path):
    """A stand-in nvidia-smi printing a 2 MB product name at every poll: /metrics stays small and the
    cut is logged once, not at every poll."""
    report = tmp_path / "long.xml"
    report.write_bytes(with_long_texts(2_000_000))
    binary = smi_stand_in(tmp_path, report)
    port = free_port()
    with run_daemon(tmp_path, ["--reader", "nvidia-smi", "--nvidia-smi", str(binary), "--interval", "0.5",
                               "--metrics", f"tcp:{port}:interface=127.0.0.1"]) as daemon:
        daemon.wait_samples(4)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            page = response.read()
        log = daemon.log()
    print(f"/metrics {len(page)} bytes, log {len(log)} bytes")
    assert len(page) < 200_000, len(page)
    assert (NAME + "x" * 10).encode() in page
    assert log.count("product_name") == 1, log[-3000:]
    assert len(log) < 100_000
