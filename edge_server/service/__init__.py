"""Running as a service: daemon states, systemd's notify protocol, liveness for the watchdog."""
