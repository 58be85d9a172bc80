"""The metrics web: `metrics` is the site and ``/metrics`` (with `metrics_health`), `webbounds` its
bounds; `websecure` puts it under ``--web-config``."""
