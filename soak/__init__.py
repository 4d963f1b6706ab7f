"""Soak: minutes of mixed traffic against the proxy (a subprocess, the full chain) in front
of the simulator, reporting RSS, open fds, open holds and error counts over time. `make soak`."""
