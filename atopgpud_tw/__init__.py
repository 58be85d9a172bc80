"""atopgpud_tw: a GPU statistics daemon for atop, on Twisted.

A folder per role, in the order a figure flows (docs/design.md has a line per module):
``readers/`` acquire (NVML in ``readers/nvml/``, nvidia-smi in ``readers/smi/``)
and hand over one `snapshot.Snapshot` per poll; `counters` folds it into
cumulative counters; ``server/`` serves them to atop and to Prometheus; ``codec/``
is the wire format, shared with the ``atopgpu`` client (``atopgpu/``); ``sim/`` is
a driver for the readers to read where there is no GPU; `tap`, `plugin` and
``__main__`` are the wiring.
"""

__version__ = "0.1.0"
