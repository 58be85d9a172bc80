"""Serving atop: the poller folds each Snapshot into the `board` (counters, replies
rendered once per poll by `render`, each client's queue of exits and version 1
session by `clients`); `protocol` answers requests from the board, one turn at a time."""
