"""The GPU simulator: a simulated libnvidia-ml beneath the real pynvml, driven by a JSON scenario.

See docs/simulator.md.  `simulated_binding` is the one way in: it gives a
private copy of nvidia-ml-py's `pynvml` module with the simulated library
(`library.SimulatedLibrary`) installed as its ``nvmlLib``, over the driver
model (`nvml.SimulatedNvml`) of a scenario.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import itertools
import json
import sys
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from atopgpud_tw.sim.nvml import SimulatedNvml
from atopgpud_tw.sim.scenario import Scenario, ScenarioError, load_scenario, parse_scenario

__all__ = [
    "SimulatedNvml",
    "simulated_binding",
    "binding_over",
    "fresh_pynvml",
    "Scenario",
    "ScenarioError",
    "load_scenario",
    "parse_scenario",
    "demo_scenario",
]

#: the folder that puts a simulated `pynvml` first on PYTHONPATH (shim/pynvml.py)
SHIM = Path(__file__).resolve().with_name("shim")
_copies = itertools.count(1)


def demo_scenario() -> Scenario:
    """The built-in demo: two GPUs with processes that start and stop."""
    text = resources.files("atopgpud_tw.sim").joinpath("demo.json").read_text(encoding="utf-8")
    return parse_scenario(json.loads(text))


@functools.cache
def pynvml_origin() -> str:
    """The file of the installed nvidia-ml-py `pynvml` module, never a stand-in such as the shim's."""
    for entry in sys.path:
        spec = importlib.machinery.PathFinder.find_spec("pynvml", [entry])
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        if "def _nvmlGetFunctionPointer(" in Path(spec.origin).read_text(encoding="utf-8", errors="replace"):
            return spec.origin
    raise ImportError("the simulator needs nvidia-ml-py (the pynvml module) installed")


@functools.cache
def _pynvml_code() -> Any:
    """The real pynvml's compiled module body, read once per process (each copy runs it afresh)."""
    spec = importlib.util.spec_from_file_location("pynvml", pynvml_origin())
    assert spec is not None and isinstance(spec.loader, importlib.machinery.SourceFileLoader)
    return spec.loader.get_code("pynvml")


def fresh_pynvml(name: str | None = None) -> ModuleType:
    """A private copy of the real `pynvml` module: its own nvmlLib, function-pointer cache and refcount."""
    name = name or f"atopgpud_tw.sim._pynvml_{next(_copies)}"
    spec = importlib.util.spec_from_file_location(name, pynvml_origin())
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    # the module looks itself up in sys.modules while it is being executed
    sys.modules[name] = module
    try:
        exec(_pynvml_code(), module.__dict__)
    finally:
        del sys.modules[name]
    return module


def binding_over(model: SimulatedNvml, module: ModuleType | None = None) -> ModuleType:
    """`module` (a fresh copy of pynvml by default) with a simulated library over `model` as its nvmlLib."""
    from atopgpud_tw.sim.library import SimulatedLibrary

    module = module or fresh_pynvml()
    module.nvmlLib = SimulatedLibrary(model, module)  # type: ignore[attr-defined]  # pynvml's global
    return module


def simulated_binding(scenario: Scenario, clock: Callable[[], float] | None = None) -> ModuleType:
    """The NVML binding a reader is given on a simulated host: the real pynvml over the simulated library.

    Readers, tests and benchmarks get their simulated NVML through this one
    function.  ``binding.nvmlLib`` is the library (its ``calls`` count the C
    calls), ``binding.nvmlLib.model`` the driver model.
    """
    return binding_over(SimulatedNvml(scenario, clock=clock))
