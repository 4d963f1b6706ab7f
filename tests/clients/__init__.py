"""Helpers that drive real clients (Codex CLI) against the proxy in tests."""
