"""NVML's return codes (nvml.h), one table for the readers and the simulator alike."""

from __future__ import annotations

#: each code by its name without the ``NVML_ERROR_`` prefix
CODES = {
    "UNINITIALIZED": 1,
    "INVALID_ARGUMENT": 2,
    "NOT_SUPPORTED": 3,
    "NO_PERMISSION": 4,
    "NOT_FOUND": 6,
    "INSUFFICIENT_SIZE": 7,
    "DRIVER_NOT_LOADED": 9,
    "TIMEOUT": 10,
    "LIBRARY_NOT_FOUND": 12,
    "FUNCTION_NOT_FOUND": 13,
    "GPU_IS_LOST": 15,
    "OPERATING_SYSTEM": 17,
    "LIB_RM_VERSION_MISMATCH": 18,
    "GPU_NOT_FOUND": 28,
    "UNKNOWN": 999,
}
#: each name by its code
NAMES = {code: name for name, code in CODES.items()}
#: the codes after which NVML has to be initialised again
LIFECYCLE = {code: NAMES[code] for code in (CODES["UNINITIALIZED"], CODES["DRIVER_NOT_LOADED"],
                                            CODES["LIB_RM_VERSION_MISMATCH"])}
