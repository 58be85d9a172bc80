"""The metrics web: `metrics` is ``/metrics`` (with `metrics_health` and `page`),
`metrics_web` the listener's other pages, `webbounds` its bounds."""
