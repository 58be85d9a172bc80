"""The NVML reader: the real pynvml binding, called in one daemon thread.

`reader` (NvmlReader: the cards, their keys, opening and reopening NVML, the
poll, its backoff), `device` (one device's calls through one choke point, its
readings), `calls` (what a call's answer means, and `Attempt`, the one adapter
from a call to a reading or a recorded problem), `direct` (the calls of every
poll through the binding's function table), `support` (NOT_SUPPORTED spells),
`samples` (the sample streams that make busy figures exact),
`mig` (a card in MIG mode and its instances), `health` (the figures only
``/metrics`` asks for, and XID events), `worker` (the thread), `watchdog`
(a call that does not return).
"""
