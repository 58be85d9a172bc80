"""The NVML reader: the real pynvml binding, called in one daemon thread.

`reader` (NvmlReader: the cards, their keys, opening and reopening NVML, the
poll), `device` (one device's calls through one choke point, its readings,
its backoff), `samples` (the sample streams that make busy figures exact),
`mig` (a card in MIG mode and its instances), `health` (the figures only
``/metrics`` asks for, and XID events), `worker` (the thread), `watchdog`
(a call that does not return).
"""
