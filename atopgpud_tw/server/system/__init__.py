"""Meeting the host: sockets (`endpoints`, `listening`, `activation`, `accepting`,
`sockdiag`), who may connect (`access`), systemd (`notify`) and signals (`signals`)."""
