"""The process around the app: listening sockets, the --workers supervisor, logs and metrics."""
