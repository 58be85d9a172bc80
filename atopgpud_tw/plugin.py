"""The service maker twistd finds as a plugin (``twistd -n atopgpud``), and that the ``atopgpud``
command uses directly: the plugin scan would write ``dropin.cache``, read-only under the unit."""

from twisted.application.service import ServiceMaker

atopgpud = ServiceMaker(
    "atopgpud",
    "atopgpud_tw.tap",
    "Cumulative NVIDIA GPU statistics for atop",
    "atopgpud",
)
