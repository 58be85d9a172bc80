"""Meeting the host: sockets (`endpoints`, `listening`, `activation`, `accepting`),
who may connect (`access`), systemd (`notify`) and signals (`signals`)."""
