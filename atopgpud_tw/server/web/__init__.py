"""The metrics web: `metrics` is ``/metrics`` (with `metrics_atop`, `metrics_health`
and `page`), `metrics_web` the listener's other pages, `webbounds` its bounds;
`workloads` and `metrics_workloads` the sums per workload (``--workloads``)."""
