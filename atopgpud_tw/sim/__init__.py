"""The GPU simulator: a pynvml stand-in driven by a JSON scenario (docs/simulator.md)."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any, Callable

from atopgpud_tw.sim.nvml import SimulatedNvml
from atopgpud_tw.sim.scenario import Scenario, ScenarioError, load_scenario, parse_scenario

__all__ = [
    "SimulatedNvml",
    "simulated_binding",
    "Scenario",
    "ScenarioError",
    "load_scenario",
    "parse_scenario",
    "demo_scenario",
]


def demo_scenario() -> Scenario:
    """The built-in demo: two GPUs with processes that start and stop."""
    text = resources.files("atopgpud_tw.sim").joinpath("demo.json").read_text(encoding="utf-8")
    return parse_scenario(json.loads(text))


def simulated_binding(scenario: Scenario, clock: Callable[[], float] | None = None) -> Any:
    """The NVML binding a reader is given on a simulated host.

    Readers, tests and benchmarks get their simulated NVML through this one
    function, whatever stands beneath it.
    """
    return SimulatedNvml(scenario, clock=clock)
