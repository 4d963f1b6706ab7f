"""Configuration: config.yaml deep-merged over the embedded defaults.

The defaults alone run a working proxy (the built-in simulator as the upstream, the
SQLite ledger, a demo key), so `make run` needs no file at all. Each subsystem reads
its own section; a middleware's factory gets `config.section(name)`.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import yaml

DEFAULTS: dict[str, Any] = {
    "server": {
        "host": "127.0.0.1",
        "port": 8080,
        "workers": 1,
        "log_format": "auto",  # json | console | auto (console on a terminal)
        "log_level": "info",
        "max_body_bytes": 8 * 1024 * 1024,
        "max_json_depth": 64,
        "max_input_items": 4096,
        "max_tools": 512,
        "body_read_timeout": 30.0,
    },
    # The embedded upstream simulator, started in-process when a worker's url is "embedded".
    "simulator": {"host": "127.0.0.1", "port": 0, "dialect": "vllm", "model": "tiny-org/tiny-model",
                  "max_model_len": 32768},
    "workers": [
        {
            "name": "local",
            "url": "embedded",
            "dialect": "vllm",
            "models": ["tiny-org/tiny-model"],
            "api_key": None,
            "labels": {},
            "capacity": 256,
            "timeouts": {"connect": 5.0, "first_byte": 120.0, "idle": 120.0, "total": 1800.0},
        }
    ],
    # Active checks (vLLM GET /health, SGLang GET /v1/models) and passive outlier ejection.
    "health": {
        "enabled": True, "interval_s": 5.0, "timeout_s": 2.0, "unhealthy_threshold": 2, "healthy_threshold": 1,
        "vllm_path": "/health", "sglang_path": "/v1/models",
        "outlier": {"consecutive_failures": 5, "base_ejection_s": 30.0, "max_ejection_s": 300.0},
    },
    # Failover attempts before the first byte; the pre-flight context-window check; prompt-cache
    # affinity (proxy/affinity.py: consistent hashing with bounded loads; enabled: false = least loaded).
    "routing": {"max_attempts": 3, "context_check": True, "bytes_per_token_floor": 16,
                "affinity": {"enabled": True, "epsilon": 0.25, "vnodes": 160, "hash_messages": True}},
    "metrics": {"enabled": True, "path": "/metrics"},
    "responses": {
        "ai_markers": True,
        "ai_notice": "[AI-generated content]",
        "reasoning_items": True,  # False: leave reasoning out of output, as the 000 doc does
        # With a seal key and include=reasoning.encrypted_content: False sends only the ciphertext.
        "reasoning_in_clear": True,
        "default_max_output_tokens": None,
    },
    # The order of the chain, by name; built-ins live in middlewares/, custom ones as "pkg.mod:factory".
    "pipeline": ["stateless", "auth", "limits", "tools", "balance", "notices"],
    "stateless": {"previous_response_id": "refuse"},  # refuse | ignore
    "auth": {"demo_key": True, "static_keys": []},
    "limits": {"global_concurrency": 1024, "default_key_concurrency": 64, "retry_after_s": 1},
    "tools": {"drop": None, "refuse": None},  # None: the built-in lists
    "balance": {"hold_ttl_s": 900, "demo_balance_micros": 100_000_000},
    "notices": {"header": "x-token-notice"},
    "ledger": {"backend": "sqlite", "path": "data/ledger.db"},
    # Per model, per million tokens, in micro-units of the account currency.
    "prices": {"default": {"input": 500_000, "cached_input": 100_000, "output": 1_500_000}},
    "reasoning_seal": {"keys": {}, "active": None},
    "images": {"allow_hosts": [], "allow_private": False, "resolve_timeout_s": 2.0},
}

_ENV_REF = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")


class ConfigError(Exception):
    """A configuration that cannot run; start-up prints it as one line and exits."""


def _merge(base: Any, override: Any) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = _merge(base.get(key), value) if key in base else copy.deepcopy(value)
        return merged
    return copy.deepcopy(override)


def _expand_env(value: Any) -> Any:
    """`${NAME}` as a whole string value reads the environment (secrets stay out of the file)."""
    if isinstance(value, dict):
        return {k: _expand_env(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v) for v in value]
    if isinstance(value, str):
        match = _ENV_REF.match(value)
        if match:
            return os.environ.get(match.group(1))
    return value


class Config:
    def __init__(self, data: dict[str, Any], path: Path | None = None) -> None:
        self.data = data
        self.path = path

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, overrides: dict[str, Any] | None = None) -> "Config":
        data: dict[str, Any] = copy.deepcopy(DEFAULTS)
        file_path = Path(path) if path else None
        if file_path is not None:
            try:
                loaded = yaml.safe_load(file_path.read_text()) or {}
            except (OSError, yaml.YAMLError) as exc:
                raise ConfigError(f"cannot read {file_path}: {exc}") from exc
            if not isinstance(loaded, dict):
                raise ConfigError(f"{file_path}: the top level must be a mapping")
            data = _merge(data, loaded)
        if overrides:
            data = _merge(data, overrides)
        return cls(_expand_env(data), file_path)

    @classmethod
    def from_dict(cls, overrides: dict[str, Any]) -> "Config":
        return cls.load(None, overrides)

    def section(self, name: str) -> dict[str, Any]:
        value = self.data.get(name)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"config section {name!r} must be a mapping")
        return value

    def __getitem__(self, name: str) -> Any:
        return self.data[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.data.get(name, default)
