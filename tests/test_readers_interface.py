"""Every reader provides the whole IReader interface, as tap and the metrics page use it."""

from __future__ import annotations

import pytest_twisted
from twisted.internet.task import Clock
from zope.interface.verify import verifyObject

from atopgpud_tw.readers import ReaderSettings, make_reader
from atopgpud_tw.readers.base import IReader
from atopgpud_tw.readers.nvml.reader import NvmlReader
from atopgpud_tw.readers.smi.reader import SmiReader
from atopgpud_tw.sim import demo_scenario, simulated_binding


@pytest_twisted.ensureDeferred
async def test_the_simulator_reader_provides_ireader() -> None:
    """make_reader's sim reader: open, with a watchdog on its thread."""
    from twisted.internet import reactor

    reader, layout = make_reader(ReaderSettings(kind="sim"), reactor)
    try:
        assert verifyObject(IReader, reader) and reader.name == "sim" and layout.devices
        assert reader.watchdog is not None
    finally:
        await reader.close()


def test_the_nvml_reader_provides_ireader() -> None:
    reader = NvmlReader(simulated_binding(demo_scenario()), Clock())
    assert verifyObject(IReader, reader) and reader.name == "nvml"


def test_the_nvidia_smi_reader_provides_ireader() -> None:
    """Not opened (that runs nvidia-smi): the interface is the class's."""
    reader = SmiReader(Clock(), "/nonexistent/nvidia-smi")
    assert verifyObject(IReader, reader) and reader.name == "nvidia-smi" and reader.watchdog is None
