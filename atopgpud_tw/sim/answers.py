"""What the driver model answers: plain data, which the library writes into the caller's C
structures, or `NvmlFault(code)`, which it returns as a C function does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from atopgpud_tw.nvml_codes import CODES, NAMES, NO_INSTANCE


class NvmlFault(Exception):
    """A call failed with this NVML return code (`nvml_codes.CODES`)."""

    def __init__(self, code: int) -> None:
        super().__init__(f"NVML_ERROR_{NAMES.get(code, code)}")
        self.code = code


class SymbolMismatch(Exception):
    """The binding wants a versioned symbol the library lacks (the library answers FUNCTION_NOT_FOUND)."""


def raise_fault(error: str) -> None:
    """Raise the scenario fault named `error` (an ``NVML_ERROR_*`` name, or one of `OTHER_FAULTS` but "hang")."""
    if error == "NVMLLibraryMismatchError":
        raise SymbolMismatch("simulated: the library lacks a versioned symbol")
    if error == "RuntimeError":
        raise RuntimeError("simulated: an unexpected exception in the binding")
    raise NvmlFault(CODES[error.removeprefix("NVML_ERROR_")])


# -- what the calls answer: plain data, which the library writes into the caller's C structures
# (not frozen: a test's model may shift what its parent answered) --


@dataclass(slots=True)
class Rates:
    gpu: int
    memory: int


@dataclass(slots=True)
class Memory:
    total: int
    used: int
    free: int
    reserved: int = 0


@dataclass(slots=True)
class PciInfo:
    busId: bytes
    busIdLegacy: bytes


@dataclass(slots=True)
class RunningProcess:
    pid: int
    #: bytes; None: "not available" (WDDM, some vGPU guests)
    usedGpuMemory: int | None
    gpuInstanceId: int = NO_INSTANCE
    computeInstanceId: int = NO_INSTANCE


@dataclass(slots=True)
class ProcessSample:
    pid: int
    timeStamp: int
    smUtil: int
    memUtil: int
    encUtil: int = 0
    decUtil: int = 0


@dataclass(slots=True)
class Sample:
    timeStamp: int
    value: int


class Answers(Protocol):
    """Where a GPU's readings come from, after the call's own checks (faults, NOT_SUPPORTED):
    its scenario's values (`nvml.SimulatedNvml`) or a recording (`replay.Replayed`)."""

    def rates(self, handle: Any, gpu: Any) -> Rates: ...

    def samples(self, device: Any, gpu: Any, field: str, timeStamp: int) -> tuple[int, list[Sample]]: ...

    def memory(self, handle: Any, gpu: Any, version: Any, now: float) -> Memory: ...

    def running(self, handle: Any, gpu: Any, call: str, kinds: tuple[str, ...], now: float) -> list[RunningProcess]:
        ...

    def process_samples(self, handle: Any, gpu: Any, timeStamp: int, now: float) -> list[ProcessSample]: ...
