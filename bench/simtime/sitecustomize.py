"""Time the simulated libnvidia-ml's C functions, for bench/perf.py; loaded only when asked.

bench/perf.py puts this folder first on PYTHONPATH of both daemons, with
ATOPGPUD_BENCH_SIMTIME naming a 16-byte file.  Every C function of each
`SimulatedLibrary` is then wrapped: the CPU time of the calling thread spent
in the ctypes call (arguments converted, the callback into the simulator, its
answer written back) is added up, with the number of calls, as two unsigned
64-bit integers (nanoseconds, calls) in that file, which the benchmark reads
from outside.  That is the share of each NVML call that a real driver would
replace; the binding's own wrapper code around it is not counted.
"""

import mmap
import os
import struct
import time

_path = os.environ.get("ATOPGPUD_BENCH_SIMTIME")
if _path:
    _fd = os.open(_path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(_fd, 16)
    _map = mmap.mmap(_fd, 16)
    _totals = [0, 0]
    _now = time.thread_time_ns
    _pack = struct.Struct("=QQ").pack_into

    class _Timed:
        """A C function pointer whose calls are timed; attributes (restype) go to the pointer."""

        __slots__ = ("_fn",)

        def __init__(self, fn):
            object.__setattr__(self, "_fn", fn)

        def __call__(self, *args):
            began = _now()
            try:
                return self._fn(*args)
            finally:
                _totals[0] += _now() - began
                _totals[1] += 1
                _pack(_map, 0, _totals[0], _totals[1])

        def __getattr__(self, name):
            return getattr(self._fn, name)

        def __setattr__(self, name, value):
            setattr(self._fn, name, value)

    from atopgpud_tw.sim import library as _library

    _plain_init = _library.SimulatedLibrary.__init__

    def _timed_init(self, model, binding):
        _plain_init(self, model, binding)
        for symbol in self.symbols:
            fn = self.__dict__.get(symbol)
            if fn is not None:
                self.__dict__[symbol] = _Timed(fn)

    _library.SimulatedLibrary.__init__ = _timed_init
