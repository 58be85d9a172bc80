"""``atopgpu``, the query command: a client of the daemon on the wire format (`atopgpud_tw.codec`)
and its metrics page."""
