"""Meeting the host: sockets (`listening`, `accepting`), who may connect (`access`),
systemd (`notify`) and signals (`signals`)."""
