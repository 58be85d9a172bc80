"""The simulator installed as the module ``pynvml``, for programs written against it.

Put this folder first on PYTHONPATH and name a scenario in ATOPGPUD_SCENARIO (the
built-in demo without it); every ``pynvml.X`` is then the simulator's X.  See
docs/simulator.md for the one-liner that runs another NVML program on it.
"""

import os

from atopgpud_tw.sim import SimulatedNvml, demo_scenario, load_scenario

_path = os.environ.get("ATOPGPUD_SCENARIO")
_sim = SimulatedNvml(load_scenario(_path) if _path else demo_scenario())


def __getattr__(name):
    return getattr(_sim, name)
