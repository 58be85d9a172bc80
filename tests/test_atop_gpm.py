"""atop 2.8.1 on a simulated MIG host with GPM: each MIG instance's busy figure is its GPU instance's
graphics activity (docs/mig.md, "Busy figures from GPM"); without GPM it stays -1.

The installed daemon runs ``--reader sim`` on the fixed port atop 2.8.1 uses (the
lock in atop_helpers keeps other tests off it).
"""

from __future__ import annotations

import socket
from typing import Any, Iterator

import pytest
from atop_helpers import (
    ATOP_HOST,
    ATOP_PORT,
    TcpDaemon,
    answers,
    held_atop_port,
    run_atop,
    write_scenario,
)
from atop_output import MIB, no_length_error
from atop_source import LISTEN, LOCK_PATH, SOCKET_NAME, Unavailable, built_atop
from daemon import Client
from locks import file_lock

from atopgpud_tw import codec

pytestmark = pytest.mark.e2e

DAEMON_INTERVAL = 0.25
#: an H200 in MIG mode with GPM: a GPU instance busy 60 % all the time, one busy a quarter of each 0.2 s
H200_MIG = {
    "name": "NVIDIA H200",
    "busid": "00000000:19:00.0",
    "memory_total_mib": 143771,
    "gpm": True,
    "mig": [
        {"profile": "3g.71gb", "memory_total_mib": 71424, "memory_used_mib": 2000, "gpu_instance": 2,
         "gpu_util": 60},
        {"profile": "1g.18gb", "memory_total_mib": 17920, "memory_used_mib": 500, "gpu_instance": 9,
         "gpu_timeline": {"period": 0.2, "busy": [[0, 0.05]]}},
    ],
}
#: an A100 in MIG mode: no GPM
A100_MIG = {
    "name": "NVIDIA A100-SXM4-80GB",
    "busid": "00000000:1A:00.0",
    "memory_total_mib": 81920,
    "mig": [{"profile": "7g.80gb", "memory_total_mib": 81000, "memory_used_mib": 100, "gpu_util": 90}],
}


#: a whole H200 with GPM: busy a quarter of every 0.2 s, its sample buffer a period of 1 s, so
#: that the fold's lagging window would be off per interval where GPM is not
H200 = {
    "name": "NVIDIA H200",
    "busid": "00000000:1B:00.0",
    "memory_total_mib": 143771,
    "memory_used_mib": 700,
    "gpu_timeline": {"period": 0.2, "busy": [[0, 0.05]]},
    "mem_util": 5,
    "sample_period": 1.0,
    "gpm": True,
}


@pytest.fixture
def atop_port() -> Iterator[None]:
    """The atop port, held for one test at a time; skips when it cannot be had."""
    with held_atop_port():
        yield


def _types(address: Any = (ATOP_HOST, ATOP_PORT), family: int = socket.AF_INET) -> list[Any]:
    client = Client(address, family)
    try:
        _, body = client.ask("T", 1)
    finally:
        client.close()
    return codec.parse_types(body)


def _run(scenario: Any, tmp_path: Any, *options: str, atop: str | None = None, where: Any = None,
         ) -> tuple[list[Any], Any]:
    """The daemon on `scenario` where atop 2.8.1 looks (or `where`: listen, address, family), its T
    reply, and 4 samples of atop's GPU lines."""
    daemon = TcpDaemon(scenario, tmp_path / "daemon.log", DAEMON_INTERVAL, *(where or ()))
    daemon.command += list(options)
    daemon.start()
    try:
        types = _types(daemon.address, daemon.family)
        run = run_atop(1, 4, "GPU", atop)
    finally:
        daemon.stop()
    assert run.returncode == 0, str(run)
    no_length_error(run)
    return types, run


def test_atop_shows_mig_instance_busy_from_gpm_and_minus_one_without(atop_port: None, tmp_path: Any) -> None:
    """atop 2.8.1: the H200's instances busy 60 % and 25 % over each interval, the A100's -1; the T digit
    of a GPM instance has its third bit (7), the others stay 3."""
    scenario = write_scenario(tmp_path / "mig-gpm.json", [H200_MIG, A100_MIG])
    types, run = _run(scenario, tmp_path)
    assert [t.task_support for t in types] == [7, 7, 3], types
    samples = run.samples
    assert len(samples) == 4, str(run)
    for number, sample in enumerate(samples[1:], 1):
        where = f"sample {number}\n{run}"
        big, small, other = sample.gpus
        assert [g.mem_used_kib for g in sample.gpus] == [2000 * MIB, 500 * MIB, 100 * MIB], where
        assert big.gpu_now == 60 and big.gpu_cum == 60 * big.samples, where
        # exact over the time since the poll before: 0.25 s of polls hold 0.05 to 0.1 s of busy
        assert 20 <= small.gpu_now <= 40, where
        assert abs(small.gpu_cum / small.samples - 25) <= 2.5, where
        assert (other.gpu_now, other.gpu_cum) == (-1, -1), where


def test_atop_shows_a_gpm_card_in_mig_mode_as_one_device_with_mig_card(atop_port: None, tmp_path: Any) -> None:
    """--mig card: the H200 is one device whose busy figure is the whole GPU's graphics activity (its
    own gpu_util, 40 %), digit 7; the A100 stays -1."""
    scenario = write_scenario(tmp_path / "mig-gpm-card.json", [{**H200_MIG, "gpu_util": 40}, A100_MIG])
    types, run = _run(scenario, tmp_path, "--mig", "card")
    assert [t.task_support for t in types] == [7, 3], types
    for number, sample in enumerate(run.samples[1:], 1):
        card, other = sample.gpus
        assert card.gpu_now == 40 and card.gpu_cum == 40 * card.samples, f"sample {number}\n{run}"
        assert (other.gpu_now, other.gpu_cum) == (-1, -1), f"sample {number}\n{run}"


def test_atop_shows_a_whole_gpm_card_busy_from_gpm(atop_port: None, tmp_path: Any) -> None:
    """A whole H200 with GPM: atop's busy figure each interval is GPM's (25 %), digit 7; memory busy
    stays the sample buffer's (5 %)."""
    scenario = write_scenario(tmp_path / "whole-gpm.json", [H200])
    types, run = _run(scenario, tmp_path)
    assert [t.task_support for t in types] == [7], types
    for number, sample in enumerate(run.samples[1:], 1):
        (card,) = sample.gpus
        where = f"sample {number}\n{run}"
        assert 20 <= card.gpu_now <= 40 and abs(card.gpu_cum / card.samples - 25) <= 2.5, where
        assert card.mem_now == 5, where


def test_atop_2_13_shows_mig_instance_busy_from_gpm(tmp_path: Any) -> None:
    """atop 2.13 (API 2, the abstract socket), built from its source: the same figures as atop 2.8.1."""
    try:
        binary = built_atop()
    except Unavailable as error:
        pytest.skip(str(error))
    address = b"\0" + SOCKET_NAME.encode()
    with file_lock(LOCK_PATH, 300.0):
        if answers(address, socket.AF_UNIX):
            pytest.skip(f"something already answers on @{SOCKET_NAME}; atop 2.13 needs it")
        scenario = write_scenario(tmp_path / "mig-gpm.json", [H200_MIG, A100_MIG])
        types, run = _run(scenario, tmp_path, atop=binary, where=(LISTEN, address, socket.AF_UNIX))
    assert [t.task_support for t in types] == [7, 7, 3], types
    for number, sample in enumerate(run.samples[1:], 1):
        big, small, other = sample.gpus
        where = f"sample {number}\n{run}"
        assert big.gpu_now == 60 and big.gpu_cum == 60 * big.samples, where
        assert abs(small.gpu_cum / small.samples - 25) <= 2.5, where
        assert (other.gpu_now, other.gpu_cum) == (-1, -1), where
