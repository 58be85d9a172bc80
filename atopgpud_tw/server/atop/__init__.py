"""Serving atop: the poller folds each Snapshot into the `board` (counters, replies
rendered once per poll by `render`, each client's queue of exits by `exits`,
version 1's per-client sessions by `intervals`); `protocol` answers requests from
the board, one turn at a time (`turns`)."""
