"""What the driver model raises: an NVML return code, or a fault of the binding itself.

The model (`nvml.py`, `health_model.py`, `gpm_model.py`) fails a call with
`NvmlFault(code)`; the library (`library.py`) returns its code to the caller
as a C function does, and the real binding above raises its own exception
for it.  A scenario names a fault by its NVML name or as one of
`scenario.OTHER_FAULTS`; `raise_fault` turns that name into the exception.
"""

from __future__ import annotations

from atopgpud_tw.nvml_codes import CODES, NAMES


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
