"""The service maker twistd finds as a plugin (``twistd -n atopgpud``), and that the
``atopgpud`` command uses directly, without twistd's plugin scan.

The scan writes ``twisted/plugins/dropin.cache`` beside the installed plugins; under
the shipped unit (``ProtectSystem=strict``) that directory is read-only, and every
start would log that the cache cannot be written.
"""

from twisted.application.service import ServiceMaker

atopgpud = ServiceMaker(
    "atopgpud",
    "atopgpud_tw.tap",
    "Cumulative NVIDIA GPU statistics for atop",
    "atopgpud",
)
