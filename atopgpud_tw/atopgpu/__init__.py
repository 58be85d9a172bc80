"""``atopgpu``, the query command: a client of the daemon on the wire format alone.

`connection` (endpoints, one connection, checked replies), `cli` (the command, the
figures as atop works them out, the table and JSON), `health` (``--health``: the
daemon's metrics page read back).  Nothing here imports the daemon's modules:
only `atopgpud_tw.codec`.
"""
