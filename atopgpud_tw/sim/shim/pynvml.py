"""The real nvidia-ml-py `pynvml`, over the simulated libnvidia-ml, for programs written against it.

Put this folder first on PYTHONPATH and name a scenario in ATOPGPUD_SCENARIO (docs/simulator.md).
"""

import os
import sys

from atopgpud_tw.sim import SimulatedNvml, binding_over, demo_scenario, fresh_pynvml, load_scenario

_path = os.environ.get("ATOPGPUD_SCENARIO")
_real = binding_over(SimulatedNvml(load_scenario(_path) if _path else demo_scenario()), fresh_pynvml("pynvml"))
# the import of this file gives the real module in its place
sys.modules[__name__] = _real
