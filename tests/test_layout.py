"""The layout is the design: imports point one way, docs/design.md names every module, log names stay."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest
from twisted.logger import Logger

import atopgpud_tw
from atopgpud_tw.lognames import ClassLogger

PACKAGE = Path(atopgpud_tw.__file__).parent
DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"

#: what each part may import of the package, beyond itself ("" is the top-level modules); `figures`,
#: the table of figures, imports nothing of the package, so every part may read it
ALLOWED = {
    "codec": set(),
    "atopgpu": {"codec", "figures"},
    "sim": {"nvml_codes", "figures", "regularfile", "checks"},
    "readers": {"snapshot", "health", "problems", "lognames", "nvml_codes", "figures"},
    "server": {
        "snapshot", "health", "problems", "lognames", "counters", "gpm_counters", "codec", "readers.base", "figures",
        "workloads", "regularfile", "checks",
    },
}

#: every log namespace of the daemon, as its lines show them (docs/reliability.md quotes some)
NAMESPACES = {
    "atopgpud_tw.tap",
    "atopgpud_tw.problems.ProblemLog",
    "atopgpud_tw.readers",
    "atopgpud_tw.readers.nvml",
    "atopgpud_tw.readers.nvml_device",
    "atopgpud_tw.readers.nvml_mig",
    "atopgpud_tw.readers.nvml_gpm",
    "atopgpud_tw.readers.smi",
    "atopgpud_tw.readers.smi_orphans",
    "atopgpud_tw.watchdog.HangWatchdog",
    "atopgpud_tw.board",
    "atopgpud_tw.poller.PollerService",
    "atopgpud_tw.protocol.AtopGpuProtocol",
    "atopgpud_tw.protocol.AtopGpuFactory",
    "atopgpud_tw.access.BurstLog",
    "atopgpud_tw.access.Gate",
    "atopgpud_tw.accepting.FairPort",
    "atopgpud_tw.endpoints.CheckedEndpoint",
    "atopgpud_tw.listening",
    "atopgpud_tw.listening.AcceptLog",
    "atopgpud_tw.notify.Notifier",
    "atopgpud_tw.notify.NotifyService",
    "atopgpud_tw.signals.SignalService",
    "atopgpud_tw.metrics.MetricsResource",
    "atopgpud_tw.metrics_health",
    "atopgpud_tw.workloads",
    "atopgpud_tw.webbounds.WebGuard",
    "atopgpud_tw.passwords.PasswordChecks",
    "atopgpud_tw.basicauth.Protected",
    "atopgpud_tw.websecure.WebSecurity",
}


def modules() -> list[str]:
    return sorted(
        name
        for _, name, is_package in pkgutil.walk_packages([str(PACKAGE)], "atopgpud_tw.")
        if not name.startswith("atopgpud_tw.sim.shim")
    )


def source(name: str) -> Path:
    path = PACKAGE.joinpath(*name.split(".")[1:])
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def imported(name: str) -> set[str]:
    """The package's modules `name` imports, without the ``atopgpud_tw.`` prefix."""
    found = set()
    for node in ast.walk(ast.parse(source(name).read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("atopgpud_tw"):
            base = node.module.removeprefix("atopgpud_tw").lstrip(".")
            found.update(f"{base}.{alias.name}".lstrip(".") if not base else base for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("atopgpud_tw.") for a in node.names if a.name.startswith("atopgpud_tw."))
    return found


def part(module: str) -> str:
    return module.split(".")[0] if "." in module or module in ALLOWED else ""


@pytest.mark.parametrize("name", modules())
def test_imports_point_one_way(name: str) -> None:
    own = part(name.removeprefix("atopgpud_tw."))
    if own not in ALLOWED:
        return  # the top-level modules and the wiring
    allowed = ALLOWED[own] | ({"sim"} if name == "atopgpud_tw.readers" else set())  # make_reader's "sim"
    if name == "atopgpud_tw.atopgpu.doctor":
        # doctor judges the daemon's setup by the daemon's own rules, not a copy: its option parser,
        # its allow-list and its reading of SO_PEERCRED, its words for NVML's start-up errors
        allowed |= {"tap", "server", "readers", "nvml_codes"}
    wrong = sorted(
        module
        for module in imported(name)
        if part(module) != own and not {module, part(module)} & allowed
        and module not in ("__version__", "distribution_version")
    )
    assert not wrong, f"{name} imports {wrong}"


def test_design_names_every_module() -> None:
    design = DESIGN.read_text()
    missing = []
    for name in modules():
        path = source(name).relative_to(PACKAGE)
        if path.name == "__init__.py" or path.parts[0] == "sim":
            continue
        # a module is named by its path under the package, or by its name in its folder's row
        folder = "/".join(path.parts[:-1])
        rows = [
            line
            for line in design.splitlines()
            if line.startswith("|") and (f"`{path}`" in line or folder and f"`{folder}/`" in line.split("|")[1])
        ]
        if not any(f"`{path}`" in row or f"`{path.name}`" in row for row in rows):
            missing.append(str(path))
    assert not missing, f"docs/design.md does not name {missing}"


def test_every_logger_has_its_fixed_name() -> None:
    plain = []
    for name in modules():
        for node in ast.walk(ast.parse(source(name).read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Logger":
                if not node.args and not any(k.arg == "namespace" for k in node.keywords):
                    plain.append(name)
    assert not plain, f"loggers named after their module (a move renames their lines): {plain}"
    found = set()
    for name in modules():
        module = importlib.import_module(name)
        for value in vars(module).values():
            if isinstance(value, Logger) and not isinstance(value, ClassLogger):
                found.add(value.namespace)
            if isinstance(value, type) and value.__module__ == name:
                found.update(v.namespace for v in vars(value).values() if isinstance(v, ClassLogger))
    # the ports' accept logger is made in a function (listening.listen_all): the scan above sees it named
    assert found == NAMESPACES - {"atopgpud_tw.listening"}


def test_a_class_logger_names_its_events_source() -> None:
    class Thing:
        log = ClassLogger("atopgpud_tw.thing.Thing")

    thing = Thing()
    assert thing.log.namespace == "atopgpud_tw.thing.Thing"
    assert thing.log.source is thing
    assert Thing.log.source is Thing


def _code_names() -> set[str]:
    from atopgpud_tw import nvml_codes

    return {name for name, value in vars(nvml_codes).items() if name.isupper() and isinstance(value, int)}


#: how a module may spell a code's name: ``NVML_ERROR_NOT_FOUND``, ``FIELD_NOT_SUPPORTED``, ``_TIMEOUT``
_CODE_PREFIXES = ("_", "NVML_ERROR_", "NVML_", "FIELD_")
#: what an NVML return code is read from: ``error.value``, ``entry.nvmlReturn``, ``getattr(error, "value")``
_CODE_FIELDS = {"value", "nvmlReturn"}


def _bare(name: str) -> str:
    for prefix in _CODE_PREFIXES:
        name = name.removeprefix(prefix)
    return name


def _literal(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) is int


def _reads_code(node: ast.AST, held: frozenset[str] | set[str] = frozenset()) -> bool:
    if isinstance(node, ast.Name):
        return node.id in held  # a name the function set from a code: ``value = getattr(error, "value")``
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "int" and node.args:
        node = node.args[0]  # int(entry.nvmlReturn)
    if isinstance(node, ast.Attribute):
        return node.attr in _CODE_FIELDS
    return (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant) and node.args[1].value in _CODE_FIELDS)


def test_nvml_codes_are_named_from_nvml_codes_only() -> None:
    """No module but nvml_codes.py types an NVML return code as a number: neither a constant of a
    code's name (``INVALID_ARGUMENT = 2``) nor a code read from an error or an entry compared with
    one (``error.value == 13``, ``int(entry.nvmlReturn) == 0``)."""
    from atopgpud_tw import nvml_codes

    codes = _code_names()
    assert nvml_codes.CODES == {name: getattr(nvml_codes, name) for name in nvml_codes.CODES}
    assert {"SUCCESS", "NOT_SUPPORTED", "FUNCTION_NOT_FOUND", "UNKNOWN"} <= codes
    typed = []
    names = [*modules(), "atopgpud_tw.sim.shim.pynvml"]
    for name in names:
        if name == "atopgpud_tw.nvml_codes":
            continue
        tree = ast.parse(source(name).read_text())
        held: dict[ast.AST, set[str]] = {}
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = {t.id for n in ast.walk(function) if isinstance(n, ast.Assign) and _reads_code(n.value)
                         for t in n.targets if isinstance(t, ast.Name)}
                held.update((n, names) for n in ast.walk(function) if isinstance(n, ast.Compare) and names)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _literal(node.value):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                typed += [f"{name}:{node.lineno} {t.id}" for t in targets
                          if isinstance(t, ast.Name) and _bare(t.id) in codes]
            elif isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(_reads_code(side, held.get(node, set())) for side in sides):
                    numbers = [side for side in sides if _literal(side)]
                    numbers += [e for side in sides if isinstance(side, (ast.Tuple, ast.Set, ast.List))
                                for e in side.elts if _literal(e)]
                    typed += [f"{name}:{node.lineno} compares a code with {ast.unparse(n)}" for n in numbers]
    assert not typed, f"NVML codes typed as numbers (name them from atopgpud_tw.nvml_codes): {typed}"


#: nvml_codes' constants that nvidia-ml-py names otherwise than ``NVML_<name>`` or ``NVML_ERROR_<name>``
_BINDING_NAMES = {"EVENT_XID": "nvmlEventTypeXidCriticalError",
                  "VALUE_NOT_AVAILABLE": "NVML_VALUE_NOT_AVAILABLE_ulonglong"}


def test_every_nvml_constant_has_the_binding_s_value() -> None:
    """Each constant of nvml_codes has the value nvidia-ml-py gives it, where the binding has it."""
    import pynvml

    from atopgpud_tw import nvml_codes

    checked = {}
    for name in _code_names():
        for spelled in (_BINDING_NAMES.get(name), f"NVML_ERROR_{name}", f"NVML_{name}"):
            if spelled and hasattr(pynvml, spelled):
                bound = getattr(pynvml, spelled)
                checked[name] = getattr(bound, "value", bound)  # (a ctypes number: its value)
                break
    assert {name: getattr(nvml_codes, name) for name in checked} == checked
    assert {"GPU_UTILIZATION_SAMPLES", "VALUE_TYPE_UNSIGNED_INT", "DEVICE_MIG_ENABLE", "EVENT_XID",
            "VALUE_NOT_AVAILABLE", "TEMPERATURE_GPU", "NOT_FOUND"} <= checked.keys()


def test_nvml_outcomes_are_caught_in_calls_only() -> None:
    """No module but readers/nvml/calls.py has an ``except`` clause on an NVML outcome: the others
    branch on the value `calls.answer` gives (one answer type, one place that catches)."""
    from atopgpud_tw.readers.nvml import calls

    outcomes = {name for name, value in vars(calls).items()
                if isinstance(value, type) and issubclass(value, calls.Outcome)} | {"READING"}
    caught = []
    for name in modules():
        if name == "atopgpud_tw.readers.nvml.calls":
            continue
        for node in ast.walk(ast.parse(source(name).read_text())):
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                named = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node.type)
                         if isinstance(n, (ast.Name, ast.Attribute))}
                caught += [f"{name}:{node.lineno} except {ast.unparse(node.type)}" for _ in named & outcomes][:1]
    assert not caught, f"NVML outcomes caught outside readers/nvml/calls.py (use calls.answer): {caught}"
