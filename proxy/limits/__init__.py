"""Limit counting (middlewares/limits.py is the policy): base (the interface), memory (this
process's counters), redis_backend + scripts (one Redis shared by every replica)."""
