"""The C symbols the simulated libnvidia-ml exports, and those each driver branch lacks.

Apart from the library's code, so a scenario's ``driver`` and ``missing_symbols`` can be
checked without loading it; `SimulatedLibrary` checks its table against `LIBRARY_SYMBOLS`.
"""

from __future__ import annotations

from atopgpud_tw.figures import FIGURES

#: the C symbols of GPM (sim/library.py)
GPM_SYMBOLS = (
    "nvmlGpmQueryDeviceSupport",
    "nvmlGpmSampleAlloc",
    "nvmlGpmSampleFree",
    "nvmlGpmSampleGet",
    "nvmlGpmMigSampleGet",
    "nvmlGpmMetricsGet",
)

#: the events' C symbols, and the NVLink state that tells which links there are
EVENT_SYMBOLS = (
    "nvmlEventSetCreate",
    "nvmlDeviceRegisterEvents",
    "nvmlDeviceGetSupportedEventTypes",
    "nvmlEventSetWait_v2",
    "nvmlEventSetFree",
)
#: the C symbols of the health figures (every NVML call of the table of figures) and NVML events
HEALTH_SYMBOLS = tuple(dict.fromkeys([
    *(name for figure in FIGURES if figure.nvml is not None for name in (figure.nvml.function, *figure.nvml.older)),
    "nvmlDeviceGetNvLinkState",
    *EVENT_SYMBOLS,
]))

#: the C symbols of libnvidia-ml the simulated library has (sim/library.py)
LIBRARY_SYMBOLS = (
    "nvmlInit_v2",
    "nvmlInitWithFlags",
    "nvmlShutdown",
    "nvmlErrorString",
    "nvmlSystemGetDriverVersion",
    "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetName",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetSamples",
    "nvmlDeviceGetProcessUtilization",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses_v2",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceIsMigDeviceHandle",
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
    "nvmlDeviceGetGpuInstanceId",
    "nvmlDeviceGetComputeInstanceId",
    "nvmlDeviceGetSerial",
    "nvmlDeviceGetVbiosVersion",
    "nvmlSystemGetCudaDriverVersion",
    "nvmlSystemGetCudaDriverVersion_v2",
) + HEALTH_SYMBOLS + GPM_SYMBOLS
_V3_LISTS = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3")
_V2_LISTS = ("nvmlDeviceGetComputeRunningProcesses_v2", "nvmlDeviceGetGraphicsRunningProcesses_v2")
#: driver branches: the version the library reports and the symbols its libnvidia-ml lacks
DRIVERS = {
    "current": ("999.99.99-sim", ()),
    # 510.39.01 brought the _v3 process lists and nvmlDeviceGetMemoryInfo_v2
    # GPM is in the R525 NVML reference (Hopper); these older libraries lack its functions
    "470": ("470.256.02", _V3_LISTS + ("nvmlDeviceGetMemoryInfo_v2",) + GPM_SYMBOLS),
    # the _v2 process lists need 450.66: an early R450 has only the unversioned (v1) ones
    "450": ("450.51.06", _V3_LISTS + _V2_LISTS + ("nvmlDeviceGetMemoryInfo_v2",) + GPM_SYMBOLS),
}
#: the CUDA version each driver branch supports, as nvmlSystemGetCudaDriverVersion answers it (12080: 12.8)
CUDA_VERSIONS = {"current": 12080, "470": 11040, "450": 11000}
