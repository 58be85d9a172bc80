"""The parser on real ``nvidia-smi -q -x`` documents (shared/fixtures/nvidia-smi).

The expectations below were written by reading each XML file, not by running the
parser: bus id, name, memory total/used in MiB, gpu/memory utilization, and the
processes as (pid, type, MiB).  Per-process busy figures are not in ``-q -x``.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest

from atopgpud_tw.readers.smi.report import parse_report
from atopgpud_tw.snapshot import UNSUPPORTED

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "nvidia-smi"
NA = UNSUPPORTED


class Gpu(NamedTuple):
    busid: str
    name: str
    total_mib: int
    used_mib: int
    gpu_util: int
    mem_util: int
    processes: tuple[tuple[int, str, int], ...] = ()


def same(busids: list[str], *rest: object) -> list[Gpu]:
    """Identical cards that differ only by bus id."""
    return [Gpu(busid, *rest) for busid in busids]


WINDOWS_PIDS = (
    7724,
    10808,
    11556,
    12452,
    12636,
    13120,
    14296,
    16508,
    16592,
    20920,
    21004,
    21036,
    21048,
    21104,
    21292,
    21472,
    21852,
    22600,
    23652,
    25436,
    25520,
    25696,
    26972,
    27148,
    27628,
    30212,
)

EXPECTED: dict[str, list[Gpu]] = {
    # MIG on, no -L names here: instances named by SMs and memory; busy unsupported
    "a100-sxm4-40gb-510.47.03-mig.xml": [
        Gpu("00000000:00:04.0/1.0", "42sm.20gb", 19968, 19, NA, NA),
        Gpu("00000000:00:04.0/2.0", "42sm.20gb", 19968, 19, NA, NA),
    ],
    "a10g-515.105.01.xml": [
        Gpu("00000000:00:1E.0", "NVIDIA A10G", 23028, 22, 0, 0, ((725, "G", 22),)),
    ],
    "geforce-gt-1030-470.74.xml": [
        Gpu(
            "00000000:2D:00.0",
            "NVIDIA GeForce GT 1030",
            1998,
            875,
            0,
            3,
            (
                (607, "G", 547),
                (746, "G", 0),
                (750, "G", 67),
                (816, "G", 51),
                (992, "G", 1),
                (1000, "G", 1),
                (1005, "G", 1),
                (1006, "G", 1),
                (1264, "G", 130),
                (2028, "G", 65),
            ),
        ),
    ],
    "geforce-gtx-1070-x6-384.66.xml": [
        Gpu(
            "00000000:01:00.0",
            "GeForce GTX 1070",
            8112,
            2466,
            100,
            100,
            (
                (1357, "G", 99),
                (2384, "G", 79),
                (3093, "C", 2283),
            ),
        ),
        # the miner's pid under every GPU: listed per GPU, not merged across them
        *same(
            [f"00000000:{bus}:00.0" for bus in ("03", "04", "08", "09", "0A")],
            "GeForce GTX 1070",
            8114,
            2294,
            100,
            100,
            ((3093, "C", 2283),),
        ),
    ],
    "geforce-gtx-1660-ti-418.43.xml": [
        Gpu("00000000:43:00.0", "Graphics Device", 5912, 0, 0, 1),
    ],
    "geforce-rtx-2070-x2-590.44.01.xml": same(
        ["00000000:01:00.0", "00000000:02:00.0"], "NVIDIA GeForce RTX 2070", 8192, 1, 0, 0
    ),
    "geforce-rtx-2080-516.59-win.xml": [
        Gpu(
            "00000000:0A:00.0",
            "NVIDIA GeForce RTX 2080",
            8192,
            862,
            2,
            7,
            # WDDM: used_memory N/A for every process, not known: -1 KiB
            tuple((pid, "C+G", NA / 1024) for pid in WINDOWS_PIDS),
        ),
    ],
    "geforce-rtx-2080-ti-x2-410.73.xml": same(
        ["00000000:02:00.0", "00000000:03:00.0"], "GeForce RTX 2080 Ti", 10989, 0, 0, 0
    ),
    "geforce-rtx-3060-laptop-515.65.01.xml": [
        Gpu("00000000:01:00.0", "NVIDIA GeForce RTX 3060 Laptop GPU", 6144, 5, 0, 0, ((28543, "G", 4),)),
    ],
    "geforce-rtx-3080-536.40-win.xml": [
        Gpu("00000000:04:00.0", "NVIDIA GeForce RTX 3080", 10240, 1128, 0, 37),
    ],
    "geforce-rtx-3090-590.44.01.xml": [
        Gpu("00000000:09:00.0", "NVIDIA GeForce RTX 3090", 24576, 7, 0, 1),
    ],
    "geforce-rtx-4090-535.86.05.xml": [
        Gpu("00000000:84:00.0", "NVIDIA GeForce RTX 4090", 24564, 2, 0, 0),
    ],
    "h100-80gb-hbm3-x8-570.86.15.xml": same(
        [f"00000000:{bus}:00.0" for bus in ("04", "05", "0B", "0C", "84", "85", "8B", "8C")],
        "NVIDIA H100 80GB HBM3",
        81559,
        1,
        0,
        0,
    ),
    "quadro-p2000-525.125.06.xml": [
        Gpu("00000000:17:00.0", "Quadro P2000", 5120, 1, 0, 0),
    ],
    "rtx-4000-sff-ada-595.84.xml": [
        Gpu(
            "00000000:06:00.0",
            "NVIDIA RTX 4000 SFF Ada Generation",
            20475,
            3534,
            0,
            37,
            (
                (1842, "G", 410),
                (3190, "G", 451),
                (4937, "C", 160),
                (34626, "C+G", 183),
            ),
        ),
    ],
    "tesla-p100-pcie-16gb-510.47.03.xml": [
        Gpu("00000000:00:04.0", "Tesla P100-PCIE-16GB", 16384, 0, 0, 0),
    ],
    "tesla-t4-515.105.01.xml": [
        Gpu("00000000:00:1E.0", "Tesla T4", 15360, 1032, 0, 0, ((675, "G", 22), (5762, "C", 1005))),
    ],
    "tesla-v100-sxm3-32gb-410.104.xml": [
        Gpu("00000000:34:00.0", "Tesla V100-SXM3-32GB", 32480, 0, 0, 0),
    ],
}


def corpus_files() -> list[str]:
    if not CORPUS.is_dir():
        return []
    return sorted(path.name for path in CORPUS.glob("*.xml"))


def read(name: str) -> bytes:
    if not CORPUS.is_dir():
        pytest.skip(f"the shared nvidia-smi corpus is not at {CORPUS}")
    return (CORPUS / name).read_bytes()


def test_every_corpus_file_has_expectations() -> None:
    """A file added to the corpus without expectations here fails rather than passing unseen."""
    if not CORPUS.is_dir():
        pytest.skip(f"the shared nvidia-smi corpus is not at {CORPUS}")
    assert corpus_files() == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_file_reads_as_expected(name: str) -> None:
    """Every device of the file, with its memory, utilization and processes, and no problem."""
    devices, problems = parse_report(read(name))
    assert problems == {}
    seen = [
        Gpu(
            d.busid,
            d.name,
            d.memory_total_kib / 1024,
            d.memory_used_kib / 1024,
            d.gpu_busy,
            d.mem_busy,
            tuple((p.pid, p.kind, p.memory_kib / 1024) for p in d.processes),
        )
        for d in devices
    ]
    assert seen == EXPECTED[name]
    for device in devices:
        assert device.present
        assert {(p.gpu_busy, p.mem_busy) for p in device.processes} <= {(NA, NA)}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_keys_are_uuids(name: str) -> None:
    """Every corpus card has a <uuid>: it is the key (MIG instances: the card's, then gi.ci)."""
    devices, _ = parse_report(read(name))
    assert all(d.key.startswith("GPU-") for d in devices)
    assert len({d.key for d in devices}) == len(devices)


def test_corpus_mig_card_mode() -> None:
    """The A100 in card mode: one device holding both instances' memory."""
    (card,), problems = parse_report(read("a100-sxm4-40gb-510.47.03-mig.xml"), mig="card")
    assert problems == {}
    assert (card.key, card.busid, card.name) == (
        "GPU-27b94a00-ed54-5c24-b1fd-1054085de32a",
        "00000000:00:04.0",
        "NVIDIA A100-SXM4-40GB",
    )
    assert (card.memory_total_kib, card.memory_used_kib) == (2 * 19968 * 1024, 2 * 19 * 1024)
    assert (card.gpu_busy, card.mem_busy, card.processes) == (NA, NA, ())


def test_corpus_mig_instance_keys() -> None:
    """The instances' keys and bus ids follow the identity scheme: card, then gi.ci."""
    devices, _ = parse_report(read("a100-sxm4-40gb-510.47.03-mig.xml"))
    assert [d.key for d in devices] == [
        "GPU-27b94a00-ed54-5c24-b1fd-1054085de32a/1.0",
        "GPU-27b94a00-ed54-5c24-b1fd-1054085de32a/2.0",
    ]
