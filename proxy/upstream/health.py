"""Worker discovery at start-up and active health checks in the background.

Start-up asks every worker's GET /v1/models once: the models it serves (when `models` is
omitted in config.yaml), each model's max_model_len (the context window), and the dialect
(when `dialect: detect`: `owned_by` "vllm" / "sglang", else the Server header). A worker
that does not answer is retried by every round of the checker.

Probes (proxy/http/probes.py). Liveness (`/livez`, `/healthz`) depends on nothing: the process
answers. Readiness (`/readyz`) is `Readiness.verdict`: some worker takes traffic and the
ledger answers a cheap read within `LEDGER_TIMEOUT_S`. The ledger read is shared by
concurrent probes and reused for `LEDGER_TTL_S`, so an unauthenticated flood of /readyz
costs at most one ledger round trip per interval. Neither says which worker or why: the
per-worker state is in /metrics and the check errors in the log.

The checker (a task owned by a cleanup context) probes each worker every `interval_s`:
vLLM GET /health; SGLang GET /v1/models (SGLang's /health runs a generation, so it is
never polled). `unhealthy_threshold` failures in a row mark a worker unhealthy,
`healthy_threshold` passes in a row healthy again; a passing check also re-admits a
passively ejected worker once its ejection time is over (WorkerPool.readmit).

With checks enabled a worker starts unhealthy and takes no traffic until a check passes:
the first round runs at start-up (a worker that is up is in before the first request),
and a single pass is enough for that first verdict (Envoy's initial health check). A
worker down at start-up is retried by every round, as any unhealthy worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

from proxy.logs import log
from proxy.upstream.workers import Worker, WorkerPool

if TYPE_CHECKING:  # settings classes, for annotations only
    from proxy.config.sections import Health

_WINDOW_KEYS = ("max_model_len", "context_window", "context_length", "max_context_length")


class CheckFailed(Exception):
    pass


def _detect_dialect(owned_by: set[str], server: str) -> str | None:
    for dialect in ("sglang", "vllm"):
        if dialect in owned_by or dialect in server:
            return dialect
    return None


async def discover(session: aiohttp.ClientSession, worker: Worker, timeout_s: float) -> None:
    """GET /v1/models: models (if omitted), context windows, dialect (if "detect")."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(worker.endpoint("/v1/models"), headers=worker.auth_headers(),
                               timeout=timeout) as resp:
            raw = await resp.read()
            server = resp.headers.get("Server", "").lower()
            if resp.status != 200:
                raise CheckFailed(f"/v1/models answered {resp.status}")
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise CheckFailed(f"/v1/models: {type(exc).__name__}: {exc}") from None
    try:
        data = orjson.loads(raw)
        entries = [e for e in data["data"] if isinstance(e, dict) and isinstance(e.get("id"), str)]
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckFailed(f"/v1/models: not an OpenAI model list ({type(exc).__name__})") from None
    windows: dict[str, int] = {}
    for entry in entries:
        for key in _WINDOW_KEYS:
            value = entry.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                windows[entry["id"]] = value
                break
    if worker.dialect == "detect":
        owned = {str(e.get("owned_by", "")).lower() for e in entries}
        detected = _detect_dialect(owned, server)
        if detected is None:
            detected = "vllm"
            log.warning("dialect not detected; assuming vllm", worker=worker.name, server=server,
                        owned_by=sorted(owned))
        worker.dialect = detected
        log.info("worker dialect detected", worker=worker.name, dialect=detected)
    served = [e["id"] for e in entries]
    if not worker.models_known:
        worker.models = tuple(served)
        worker.models_known = True
        log.info("worker models discovered", worker=worker.name, models=served)
    else:
        missing = [m for m in worker.models if m not in served]
        if missing and served:
            log.warning("configured models not listed by the worker", worker=worker.name, missing=missing)
    for model in worker.models:
        if model in windows:
            worker.max_model_len[model] = windows[model]


class HealthChecker:
    def __init__(self, pool: WorkerPool, session: aiohttp.ClientSession, settings: Health) -> None:
        self.pool = pool
        self.session = session
        self.settings = settings
        self.discovered: set[int] = set()
        self.rounds = 0

    def _path(self, worker: Worker) -> str:
        return self.settings.vllm_path if worker.dialect == "vllm" else self.settings.sglang_path

    async def probe(self, worker: Worker) -> None:
        """One check; raises CheckFailed. A worker not yet discovered is discovered instead."""
        if id(worker) not in self.discovered:
            await discover(self.session, worker, self.settings.timeout_s)
            self.discovered.add(id(worker))
            return
        timeout = aiohttp.ClientTimeout(total=self.settings.timeout_s)
        try:
            async with self.session.get(worker.endpoint(self._path(worker)), headers=worker.auth_headers(),
                                        timeout=timeout) as resp:
                await resp.read()
                if resp.status != 200:
                    raise CheckFailed(f"{self._path(worker)} answered {resp.status}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise CheckFailed(f"{self._path(worker)}: {type(exc).__name__}: {exc}") from None

    def record(self, worker: Worker, error: str | None) -> None:
        s = self.settings
        if error is None:
            worker.check_failures = 0
            worker.check_successes += 1
            worker.last_check_error = None
            if not worker.healthy and (worker.awaiting_first_check or worker.check_successes >= s.healthy_threshold):
                worker.healthy = True
                log.info("worker healthy", worker=worker.name)
            worker.awaiting_first_check = False
            self.pool.readmit(worker)
        else:
            worker.check_successes = 0
            worker.check_failures += 1
            worker.last_check_error = error
            if worker.awaiting_first_check and worker.check_failures == 1:
                log.warning("worker down at start-up", worker=worker.name, error=error)
            if worker.healthy and worker.check_failures >= s.unhealthy_threshold:
                worker.healthy = False
                log.warning("worker unhealthy", worker=worker.name, error=error)

    async def check(self, worker: Worker) -> None:
        try:
            await self.probe(worker)
            error = None
        except CheckFailed as exc:
            error = str(exc)
        except Exception as exc:  # never let one odd answer kill the checker
            error = f"{type(exc).__name__}: {exc}"
        if self.settings.enabled:
            self.record(worker, error)
        elif error is not None:
            log.warning("worker discovery failed", worker=worker.name, error=error)

    async def round(self) -> None:
        workers = [w for w in self.pool.workers
                   if self.settings.enabled or id(w) not in self.discovered]
        await asyncio.gather(*(self.check(w) for w in workers))
        self.rounds += 1

    async def start(self) -> None:
        """Start-up: every worker's /v1/models at once (models, windows, dialect)."""
        await asyncio.gather(*(self.check(w) for w in self.pool.workers))
        self.rounds += 1

    async def run_forever(self) -> None:
        while True:
            self.pool.next_check_at = time.monotonic() + self.settings.interval_s
            await asyncio.sleep(self.settings.interval_s)
            try:
                await self.round()
            except Exception:  # keep checking; the next round retries
                log.exception("health round failed")


CHECKER = web.AppKey("health_checker", HealthChecker)


def health_context(session_key: Any, pool_key: Any, config_key: Any):
    """The cleanup context: discovery at start-up, then the checker task until shutdown. The keys
    name where the app keeps its client session, its workers and its configuration."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        settings = app[config_key].health
        pool: WorkerPool = app[pool_key]
        checker = HealthChecker(pool, app[session_key], settings)
        app[CHECKER] = checker
        if settings.enabled:
            for worker in pool.workers:
                worker.healthy = False
                worker.awaiting_first_check = True
        pool.check_interval_s = settings.interval_s
        pool.healthy_threshold = settings.healthy_threshold
        await checker.start()
        pool.active_checks = settings.enabled
        task = asyncio.create_task(checker.run_forever())
        try:
            yield
        finally:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    return ctx


LEDGER_TIMEOUT_S = 1.0
LEDGER_TTL_S = 1.0


class Readiness:
    """Whether this process should get traffic: (ready, reason, cause): reason one word,
    cause the ledger's (proxy/ledger/base.py FAULT_EXPLAINED's keys) when reason is "ledger"."""

    def __init__(self, pool: WorkerPool, ledger_key: Any) -> None:
        self.pool = pool
        self.ledger_key = ledger_key
        self._ledger_cause: str | None = "unreachable"  # None: the ledger answers
        self._checked_at = float("-inf")
        self._check: asyncio.Task | None = None

    async def _check_ledger(self, ledger: Any) -> str | None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(LEDGER_TIMEOUT_S):
                await ledger.get_key("")  # an indexed read through the ledger's own path
            # answers, but has a fault a table read does not show; or its spool cannot be written
            cause = ledger.fault or getattr(ledger, "spool_fault", None)
        except Exception as exc:  # a timeout, a closed or broken database: not ready
            cause = getattr(exc, "cause", None) or getattr(exc, "reason", None) or "unreachable"
            if cause != self._ledger_cause:
                log.warning("readiness: the ledger did not answer", cause=cause, error=f"{type(exc).__name__}: {exc}")
        finally:
            self._check = None
        self._ledger_cause, self._checked_at = cause, loop.time()
        return cause

    async def ledger_problem(self, app: web.Application) -> str | None:
        """The ledger's cause of not answering (FAULT_EXPLAINED's keys), None while it answers;
        checked at most every few seconds (readiness probes and alerts share the answer)."""
        ledger = app.get(self.ledger_key)
        if ledger is None:  # ledger.backend: none
            return None
        if asyncio.get_running_loop().time() - self._checked_at < LEDGER_TTL_S:
            return self._ledger_cause
        if self._check is None:
            self._check = asyncio.create_task(self._check_ledger(ledger))
        # shield: a probe that gives up does not cancel the check the others wait for
        return await asyncio.shield(self._check)

    async def verdict(self, app: web.Application) -> tuple[bool, str, str | None]:
        if not any(w.available for w in self.pool.workers):
            return False, "no_worker", None
        cause = await self.ledger_problem(app)
        if cause is not None:
            return False, "ledger", cause
        return True, "ready", None


READINESS = web.AppKey("readiness", Readiness)  # proxy.upstream.health, answers /readyz
