"""The upstream model servers (vLLM or SGLang) and the choice among them.

A worker is one chat-completions server. The pool answers "which worker takes this
request" and keeps the in-flight count that least-loaded choice and capacity need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from proxy.config import ConfigError
from proxy.errors import APIError

DIALECTS = ("vllm", "sglang", "detect")


@dataclass(frozen=True)
class Timeouts:
    connect: float = 5.0
    first_byte: float = 120.0  # request sent -> first upstream chunk; past it the client gets 504
    idle: float = 120.0  # between two upstream chunks; past it, response.failed
    total: float = 1800.0


@dataclass(eq=False)
class Worker:
    name: str
    url: str
    dialect: str = "vllm"
    models: tuple[str, ...] = ()
    api_key: str | None = None
    labels: dict[str, Any] = field(default_factory=dict)
    capacity: int = 256
    timeouts: Timeouts = field(default_factory=Timeouts)
    max_model_len: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0
    healthy: bool = True

    @property
    def chat_url(self) -> str:
        return f"{self.url.rstrip('/')}/v1/chat/completions"

    def auth_headers(self) -> dict[str, str]:
        # Each worker has its own credential; the client's Authorization never travels upstream.
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def parse_workers(raw: Any) -> list[Worker]:
    if not isinstance(raw, list) or not raw:
        raise ConfigError("workers must be a non-empty list")
    workers, names = [], set()
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict) or not entry.get("url") or not entry.get("name"):
            raise ConfigError(f"workers[{i}] needs a name and a url")
        if entry["name"] in names:
            raise ConfigError(f"workers[{i}]: duplicate worker name {entry['name']!r}")
        names.add(entry["name"])
        dialect = entry.get("dialect", "vllm")
        if dialect not in DIALECTS:
            raise ConfigError(f"workers[{i}].dialect must be one of {DIALECTS}")
        try:
            timeouts = Timeouts(**(entry.get("timeouts") or {}))
        except TypeError as exc:
            raise ConfigError(f"workers[{i}].timeouts: {exc}") from exc
        workers.append(Worker(
            name=str(entry["name"]), url=str(entry["url"]), dialect=dialect,
            models=tuple(entry.get("models") or ()), api_key=entry.get("api_key"),
            labels=dict(entry.get("labels") or {}), capacity=int(entry.get("capacity", 256)), timeouts=timeouts,
        ))
    return workers


def upstream_model_name(model: str) -> str:
    return model.split("/", 1)[1] if "/" in model else model


class WorkerPool:
    def __init__(self, workers: Iterable[Worker]) -> None:
        self.workers = list(workers)

    def serving(self, model: str) -> list[Worker]:
        return [w for w in self.workers if model in w.models]

    def models(self) -> dict[str, int | None]:
        """Every served model with its context window where a worker told us."""
        found: dict[str, int | None] = {}
        for worker in self.workers:
            for model in worker.models:
                window = worker.max_model_len.get(model)
                if found.get(model) is None:
                    found[model] = window
        return found

    def choose(self, model: str, exclude: Iterable[Worker] = ()) -> Worker:
        candidates = self.serving(model)
        if not candidates:
            raise APIError(404, f"The model '{model}' does not exist or is not served here.",
                           code="model_not_found", param="model")
        excluded = set(map(id, exclude))
        healthy = [w for w in candidates if w.healthy and id(w) not in excluded]
        if not healthy:
            raise APIError(503, f"No healthy worker serves '{model}' right now.", code="no_worker_available",
                           headers={"Retry-After": "1"})
        free = [w for w in healthy if w.in_flight < w.capacity]
        if not free:
            raise APIError(429, f"Every worker serving '{model}' is at capacity; retry shortly.",
                           code="capacity_exhausted", headers={"Retry-After": "1"})
        return min(free, key=lambda w: w.in_flight / max(w.capacity, 1))
