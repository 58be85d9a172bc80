"""NVML's return codes and the other constants of nvml.h the readers and the simulator use.

Each has the value of nvidia-ml-py's ``NVML_<name>`` (tests/test_layout.py), written here
rather than read from the binding, which would load it (about 6 MB) wherever a code is named.
"""

from __future__ import annotations

SUCCESS = 0
UNINITIALIZED = 1
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NO_PERMISSION = 4
NOT_FOUND = 6
INSUFFICIENT_SIZE = 7
DRIVER_NOT_LOADED = 9
TIMEOUT = 10
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
OPERATING_SYSTEM = 17
LIB_RM_VERSION_MISMATCH = 18
#: a structure of a version the library does not know (the simulator answers it to one)
ARGUMENT_VERSION_MISMATCH = 25
GPU_NOT_FOUND = 28
UNKNOWN = 999

#: the errors the daemon names (``NVML_ERROR_<name>`` in problems and log lines, else the
#: number) and a simulated fault may return, each by its name without the prefix: every code above
CODES = {name: code for name, code in dict(globals()).items()
         if name.isupper() and isinstance(code, int) and code not in (SUCCESS, ARGUMENT_VERSION_MISMATCH)}
#: each name by its code
NAMES = {code: name for name, code in CODES.items()}
#: the codes after which NVML has to be initialised again
LIFECYCLE = {code: NAMES[code] for code in (UNINITIALIZED, DRIVER_NOT_LOADED, LIB_RM_VERSION_MISMATCH)}
#: the codes that make a device absent for the poll
LOST = (GPU_IS_LOST, GPU_NOT_FOUND)

#: nvmlSamplingType_t: the utilization sample buffers
GPU_UTILIZATION_SAMPLES = 1
MEMORY_UTILIZATION_SAMPLES = 2
#: nvmlValueType_t: what a sample or a field value holds
VALUE_TYPE_DOUBLE = 0
VALUE_TYPE_UNSIGNED_INT = 1
VALUE_TYPE_UNSIGNED_LONG = 2
VALUE_TYPE_UNSIGNED_LONG_LONG = 3
VALUE_TYPE_SIGNED_LONG_LONG = 4
VALUE_TYPE_SIGNED_INT = 5
VALUE_TYPE_UNSIGNED_SHORT = 6
#: a counter NVML cannot give (NVML_VALUE_NOT_AVAILABLE_ulonglong)
VALUE_NOT_AVAILABLE = 0xFFFF_FFFF_FFFF_FFFF
#: nvmlDeviceGetMigMode's modes
DEVICE_MIG_DISABLE = 0
DEVICE_MIG_ENABLE = 1
#: nvmlTemperatureSensors_t: the GPU's own sensor
TEMPERATURE_GPU = 0
#: nvmlEventTypeXidCriticalError
EVENT_XID = 0x8
#: the GPU and compute instance ids of what is on no MIG instance (0xFFFFFFFF; nvml.h names none)
NO_INSTANCE = 0xFFFF_FFFF
