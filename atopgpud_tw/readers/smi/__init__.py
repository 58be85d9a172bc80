"""The nvidia-smi reader: ``nvidia-smi -q -x`` run as a child process each poll.

Shaped as the NVML reader is: `reader` (SmiReader: the poll, names from
``nvidia-smi -L`` for MIG instances), `report` (the devices of one report),
`mig` (a card's MIG instances and their names), `values` (each value of a
report's elements, or why it cannot be read), `health` (the figures of
``/metrics`` from the same report), `child` (one run of nvidia-smi, its timeout
and its output cap).
"""
