"""The model servers' side: the pooled HTTP client, the workers, routing and affinity, health
checks, and which served model a client's name means."""
