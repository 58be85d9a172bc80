"""The simulated libnvidia-ml's GPM functions (a part of `SimulatedLibrary`), so that nvidia-ml-py's
own GPM wrappers run unchanged: versions and counts checked, each metric answered in its entry.
"""

from __future__ import annotations

import ctypes
from functools import partial
from typing import Any, Callable

from atopgpud_tw.nvml_codes import ARGUMENT_VERSION_MISMATCH, INVALID_ARGUMENT, SUCCESS
from atopgpud_tw.sim.health_library import _at, _ident, _int, _ptr, _uint

#: where the opaque sample pointers the library gives out start
_SAMPLE_BASE = 0x5300_0000
_SAMPLE_STEP = 0x100


#: the model's buffer behind a sample pointer the library gave out
_sample_id = partial(_ident, base=_SAMPLE_BASE, step=_SAMPLE_STEP)


def _pointer_value(field: Any) -> int:
    """The address a structure's pointer field holds (0 for NULL)."""
    return ctypes.cast(field, ctypes.c_void_p).value or 0


def gpm_table(library: Any) -> dict[str, tuple[Any, tuple[Any, ...], Callable[..., int]]]:
    """The C symbols of GPM, for `SimulatedLibrary._table`."""
    h = _ptr
    binding = library._b

    def support(device: int | None, out: int | None) -> int:
        handle = library.model_handle(device)
        if not out:
            return INVALID_ARGUMENT
        target = ctypes.cast(out, ctypes.POINTER(binding.c_nvmlGpmSupport_t))[0]
        if target.version != binding.NVML_GPM_SUPPORT_VERSION:
            return ARGUMENT_VERSION_MISMATCH
        target.isSupportedDevice = int(library._call("nvmlGpmQueryDeviceSupport", handle))
        return SUCCESS

    def alloc(out: int | None) -> int:
        if not out:
            return INVALID_ARGUMENT
        ident = library._call("gpm_alloc")
        _at(out, _ptr)[0] = _SAMPLE_BASE + ident * _SAMPLE_STEP
        return SUCCESS

    def free(sample: int | None) -> int:
        library._call("gpm_free", _sample_id(sample))
        return SUCCESS

    def sample_get(device: int | None, sample: int | None) -> int:
        library._call("gpm_sample", library.model_handle(device), _sample_id(sample))
        return SUCCESS

    def mig_sample_get(device: int | None, gpu_instance: int, sample: int | None) -> int:
        library._call("gpm_mig_sample", library.model_handle(device), int(gpu_instance), _sample_id(sample))
        return SUCCESS

    def metrics_get(out: int | None) -> int:
        if not out:
            return INVALID_ARGUMENT
        target = ctypes.cast(out, ctypes.POINTER(binding.c_nvmlGpmMetricsGet_t))[0]
        if target.version != binding.NVML_GPM_METRICS_GET_VERSION:
            return ARGUMENT_VERSION_MISMATCH
        count = int(target.numMetrics)
        if count > binding.NVML_GPM_METRIC_MAX:
            return INVALID_ARGUMENT
        first, second = _sample_id(_pointer_value(target.sample1)), _sample_id(_pointer_value(target.sample2))
        entries = [target.metrics[i] for i in range(count)]
        answers = library._call("gpm_metrics", first, second, [int(e.metricId) for e in entries])
        for entry, (code, value) in zip(entries, answers):
            entry.nvmlReturn = code
            entry.value = value
        return SUCCESS

    return {
        "nvmlGpmQueryDeviceSupport": (_int, (h, _ptr), support),
        "nvmlGpmSampleAlloc": (_int, (_ptr,), alloc),
        "nvmlGpmSampleFree": (_int, (_ptr,), free),
        "nvmlGpmSampleGet": (_int, (h, _ptr), sample_get),
        "nvmlGpmMigSampleGet": (_int, (h, _uint, _ptr), mig_sample_get),
        "nvmlGpmMetricsGet": (_int, (_ptr,), metrics_get),
    }
