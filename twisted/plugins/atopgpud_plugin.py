"""The twistd plugin: ``twistd -n atopgpud``; behaviour lives in atopgpud_tw."""

from twisted.application.service import ServiceMaker

atopgpud = ServiceMaker(
    "atopgpud",
    "atopgpud_tw.tap",
    "Cumulative NVIDIA GPU statistics for atop",
    "atopgpud",
)
