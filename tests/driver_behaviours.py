"""What real drivers do, as simulator fields, and a host that plays them on constant loads.

Shared by the in-process checks (tests/test_driver_behaviours.py, on a task
clock), the test through the installed daemon and bench/fidelity.py.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

#: the constant loads: GPU busy, memory busy, and each process's SM busy
LOADS = {
    "gpu0": (40, 10, {100: 30, 101: 5}),
    "gpu1": (70, 20, {200: 65}),
}

def behaviours(at: float = 40.0) -> dict[str, dict[str, Any]]:
    """One driver behaviour each: the GPU fields that play it; a one-off
    (a late or a missing sample) happens at simulated time `at`."""
    return {
        "plain": {},
        "boottime clock": {"sample_clock": "boottime"},
        "offset clock": {"sample_clock": 98765.4321},
        "jitter 2 ms": {"sample_jitter_ms": 2},
        "jitter 5 ms": {"sample_jitter_ms": 5},
        "one sample 100 ms late": {"late_samples": [[at, 100]]},
        "one sample missing": {"missing_samples": [at]},
        "boundaries 3 ms after the polls": {"sample_phase": 0.003},
        "boundaries 3 ms before the polls": {"sample_phase": 1 / 6 - 0.003},
        "period 1/2 s": {"sample_period": 0.5},
        "period 1 s": {"sample_period": 1.0},
        "period 1 s, boundaries 2 ms after the polls": {"sample_period": 1.0, "sample_phase": 0.002},
        "period 1 s, boundaries 2 ms before the polls": {"sample_period": 1.0, "sample_phase": 0.998},
        "period 1.3 s": {"sample_period": 1.3},
        "samples NOT_FOUND for ever": {"samples_not_found": True},
        "process utilization once per call": {"process_utilization": "per-call"},
        "duplicate process entries": {"duplicate_process_samples": True},
        "process utilization size query says 100": {"process_list_capacity": 100},
        "lists grow between size query and fill": {
            "grow_between_calls": {"samples": [0, 0, 0, 1], "process_utilization": [0, 0, 1]}
        },
        "stray process entries": {
            "stray_process_samples": [{"pid": 999, "sm_util": 50}, {"pid": 100, "sm_util": 250, "mem_util": 7}]
        },
    }


BEHAVIOURS = behaviours()


def host(*names: str, at: float = 40.0) -> dict[str, Any]:
    """A scenario of two GPUs on constant loads, whose driver does all the behaviours `names`."""
    return {"gpus": gpus(*names, at=at)}


def gpus(*names: str, at: float = 40.0, first: int = 0) -> list[dict[str, Any]]:
    """The two GPUs of `host`, their bus ids numbered from `first`."""
    fields: dict[str, Any] = {}
    table = behaviours(at)
    for name in names:
        fields.update(copy.deepcopy(table[name]))
    cards = []
    for index, (gpu_busy, mem_busy, processes) in enumerate(LOADS.values()):
        cards.append(
            {
                "busid": f"00000000:{0x17 + first + index:02X}:00.0",
                "gpu_util": gpu_busy,
                "mem_util": mem_busy,
                "memory_used_mib": 4096,
                "processes": [
                    {"pid": pid, "memory_mib": 1024, "sm_util": sm, "mem_util": 1} for pid, sm in processes.items()
                ],
                **copy.deepcopy(fields),
            }
        )
    return cards


def compatible_pairs() -> list[tuple[str, str]]:
    """Every two behaviours that can happen together (not two of the same field)."""
    names = [name for name in BEHAVIOURS if name != "plain"]
    return [
        (a, b) for a, b in itertools.combinations(names, 2) if not set(BEHAVIOURS[a]) & set(BEHAVIOURS[b])
    ]


def expected() -> dict[int, tuple[int, int, dict[int, int]]]:
    """By GPU index: GPU busy, memory busy, busy by pid."""
    return {index: load for index, load in enumerate(LOADS.values())}
