"""The server side: the counters served over the wire, to atop and to Prometheus.

`poller` folds each Snapshot into the `board` (counters, replies rendered once
per poll by `render`, each client's queue, version 1's per-client figures by
`intervals`); `protocol` answers atop's requests
from the board, one turn at a time (`turns`), behind `access`; `endpoints`,
`listening` and `activation` give it its sockets; `metrics` (with
`metrics_atop`, `metrics_health`, `page` and `webbounds`) is ``/metrics``;
`notify` and `signals` speak to systemd and to signals.  Nothing here reads a
GPU: the poller is the one place where a reader and the board meet.
"""
