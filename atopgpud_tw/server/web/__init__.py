"""The metrics web: `metrics` is the site and ``/metrics``, `webbounds` its bounds; `websecure` puts it under
``--web-config``."""
