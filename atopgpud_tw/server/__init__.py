"""The server side: the counters served over the wire, to atop and to Prometheus.

Three wings, named for what they serve:

- `atop/`: serving atop (poller, board, exits, render, intervals, protocol, turns);
- `web/`: the metrics web (``/metrics``, its other pages, its bounds);
- `system/`: meeting the host (sockets, socket activation, peer credentials,
  systemd's notify socket, signals).

Nothing here reads a GPU: the poller is the one place where a reader and the
board meet.
"""
