"""Simulator scenarios shared by the tests: valid defaults, each test changes what it checks."""

from __future__ import annotations

#: a whole H100 at a constant 40 % / 10 % with one compute process
H100 = {
    "name": "NVIDIA H100 80GB HBM3",
    "busid": "00000000:17:00.0",
    "memory_total_mib": 81559,
    "memory_used_mib": 2048,
    "gpu_util": 40,
    "mem_util": 10,
    "processes": [{"pid": 4242, "type": "C", "memory_mib": 1024, "sm_util": 30, "mem_util": 5}],
}

#: an A10 whose utilization NVML does not report, with no processes
A10 = {
    "name": "NVIDIA A10",
    "busid": "00000000:65:00.0",
    "memory_total_mib": 24000,
    "memory_used_mib": 100,
    "gpu_util": None,
    "mem_util": None,
}


def a10_card(**fields: object) -> dict:
    """A plain A10 at 40 % / 10 % with one compute process; each test changes what it needs."""
    spec = {
        "name": "NVIDIA A10",
        "busid": "00000000:65:00.0",
        "memory_total_mib": 24000,
        "memory_used_mib": 1000,
        "gpu_util": 40,
        "mem_util": 10,
        "processes": [{"pid": 300, "memory_mib": 100, "sm_util": 20, "mem_util": 4}],
    }
    spec.update(fields)
    return spec
