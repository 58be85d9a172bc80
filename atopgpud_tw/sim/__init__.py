"""The GPU simulator: a simulated libnvidia-ml beneath the real pynvml, driven by a JSON scenario.

`simulated_binding` is the one way in (docs/simulator.md).
"""

from __future__ import annotations

import ast
import ctypes
import functools
import importlib.machinery
import importlib.util
import itertools
import json
import sys
from collections import Counter
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
_made = itertools.count()


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


#: the name under which a copy's module body finds the shared structure types while it runs
_SHARED = "__atopgpud_sim_structures__"


@functools.cache
def _pynvml_code() -> Any:
    """The real pynvml's compiled module body, read once per process (each copy runs it afresh)."""
    spec = importlib.util.spec_from_file_location("pynvml", pynvml_origin())
    assert spec is not None and isinstance(spec.loader, importlib.machinery.SourceFileLoader)
    return spec.loader.get_code("pynvml")


@functools.cache
def _sharing_code() -> tuple[Any, dict[str, type]]:
    """pynvml's module body, compiled to take its ctypes structure types from the dict with it.

    Making pynvml's 200-odd `Structure` and `Union` types is most of what running its body
    costs, and they are plain layouts (their methods read only the module's constants): a
    private run makes them once, and here each ``class`` statement becomes ``name = <that
    type>``; functions, error classes and state are each run's own."""
    origin = pynvml_origin()
    template = vars(_run(_pynvml_code(), "atopgpud_tw.sim._pynvml_types"))
    tree = ast.parse(Path(origin).read_bytes(), origin)
    defined = Counter(node.name for node in tree.body if isinstance(node, ast.ClassDef))
    shared: dict[str, type] = {}
    for index, node in enumerate(tree.body):
        if not isinstance(node, ast.ClassDef) or defined[node.name] != 1 or node.decorator_list:
            continue
        made = template.get(node.name)
        if isinstance(made, type) and issubclass(made, (ctypes.Structure, ctypes.Union)):
            shared[node.name] = made
            lookup = ast.Subscript(ast.Name(_SHARED, ast.Load()), ast.Constant(node.name), ast.Load())
            statement = ast.Assign([ast.Name(node.name, ast.Store())], lookup)
            for part in ast.walk(statement):
                ast.copy_location(part, node)
            tree.body[index] = statement
    return compile(tree, origin, "exec", dont_inherit=True), shared


def _run(code: Any, name: str, shared: dict[str, type] | None = None) -> ModuleType:
    """A new module `name` of the pynvml file, its body `code` run."""
    spec = importlib.util.spec_from_file_location(name, pynvml_origin())
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    if shared is not None:
        module.__dict__[_SHARED] = shared
    # the module looks itself up in sys.modules while it is being executed
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    finally:
        del sys.modules[name]
        module.__dict__.pop(_SHARED, None)
    return module


def fresh_pynvml(name: str | None = None) -> ModuleType:
    """A private copy of the real `pynvml` module: its own nvmlLib, function-pointer cache and refcount.

    Copies after the first share its structure types (`_sharing_code`): a process that makes
    one copy, such as a daemon on a simulated host, does not pay for preparing that."""
    name = name or f"atopgpud_tw.sim._pynvml_{next(_copies)}"
    if next(_made) == 0:
        return _run(_pynvml_code(), name)
    code, shared = _sharing_code()
    return _run(code, name, shared)


def binding_over(model: SimulatedNvml, module: ModuleType | None = None) -> ModuleType:
    """`module` (a fresh copy of pynvml by default) with a simulated library over `model` as its nvmlLib."""
    from atopgpud_tw.sim.library import SimulatedLibrary

    module = module or fresh_pynvml()
    module.nvmlLib = SimulatedLibrary(model, module)  # type: ignore[attr-defined]  # pynvml's global
    # the simulated host's processes are none of this machine's: their start times (what
    # /proc/PID/stat says on a real host) are the model's, which readers take from here
    module.process_start_time = model.process_start_time  # type: ignore[attr-defined]
    return module


def simulated_binding(scenario: Scenario, clock: Callable[[], float] | None = None) -> ModuleType:
    """The NVML binding of a simulated host: the real pynvml over the simulated library.

    ``binding.nvmlLib`` is the library (its ``calls`` count the C calls), ``.model`` the driver model."""
    return binding_over(SimulatedNvml(scenario, clock=clock))
