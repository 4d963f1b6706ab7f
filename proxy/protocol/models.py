"""Which served model a client's model name means: the one rule, used everywhere.

vLLM serves Hugging Face names (`Qwen/Qwen3-8B`) and clients built for other gateways send
`vendor/model` names for a model served as `model`. The exact name wins; one leading
segment is stripped only when no worker serves the exact name, so `Qwen/Qwen3-8B` reaches the
worker serving `Qwen/Qwen3-8B` and `openai/tiny-model` reaches the one serving `tiny-model`.
The client's string is what the Response echoes as `model`.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import Any

__all__ = ["DEFAULT_SAMPLING", "sampling_defaults", "resolve_model", "strip_vendor"]


def strip_vendor(name: str) -> str | None:
    """`name` without its leading "vendor/" segment; None when it has none to strip."""
    head, sep, rest = name.partition("/")
    if sep and head and rest:
        return rest
    return None


def resolve_model(name: str, served: Container[str] | Callable[[str], bool]) -> str | None:
    """The served name that `name` means, or None when neither it nor its stripped form is served.

    `served` is a container of served names or a predicate."""
    has = served if callable(served) else served.__contains__
    if has(name):
        return name
    bare = strip_vendor(name)
    if bare is not None and has(bare):
        return bare
    return None


# What vLLM (and SGLang) sample with when a request leaves these out and the model's
# generation_config.json says nothing; config `responses.sampling_defaults` states a model's own.
DEFAULT_SAMPLING: dict[str, float | int] = {
    "temperature": 1.0, "top_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "top_logprobs": 0,
}


def sampling_defaults(section: dict[str, Any] | None) -> dict[str, dict[str, float]]:
    """config.yaml `responses.sampling_defaults`: served model name -> the sampling values its
    server applies when a request leaves them out (vLLM reads them from the model's
    generation_config.json), only those the operator wrote. They are only echoed in the
    Response, never sent upstream. (`section` holds proxy.config.sections.ResponsesSamplingDefaults:
    the protocol sits below the configuration, so it reads their fields by name.)"""
    return {str(model): {k: getattr(values, k) for k in values.__dataclass_fields__ if getattr(values, k) is not None}
            for model, values in (section or {}).items()}
