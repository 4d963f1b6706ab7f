"""Alerts: what an operator must hear about before a client does, sent to webhooks, never on a
request's path.

With a webhook configured (`alerts.webhooks`), every `alerts.check_interval_s` the process looks
at what it already knows: a key's (or an organisation's, a team's, a user's) budget past one of
`alerts.budget_thresholds`, a key's (or a level's) balance under
`alerts.balance_below_micros`, a worker ejected, a model no worker serves, the ledger in a fault
state, its settlement spool past `alerts.spool_backlog_bytes`, the Redis limits backend
unreachable. `AlertBook` (sans-I/O: conditions and a clock in, notices out) turns the set of
conditions into notices: `firing` once when a condition appears, a `reminder` every
`alerts.reminder_s` while it lasts, `resolved` when it ends (a worker back, the fault over). A
budget's crossing is keyed by its period, so the next day or month arms it again.

Each notice goes to every webhook (`alerts.webhooks`): a generic JSON body or Slack's incoming
webhook shape, signed when the webhook has a secret (`X-Responses-Proxy-Signature: sha256=<HMAC
of "<timestamp>.<body>">`, the timestamp in `X-Responses-Proxy-Timestamp`), retried with
exponential backoff (`alerts.retries`, from `alerts.backoff_s`, up to `alerts.max_backoff_s`)
from a bounded queue by one sender task. Sent and failed notices are counted (the console's
`GET <admin>/api/alerts`, `/metrics`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

from proxy.logs import log

if TYPE_CHECKING:  # settings classes, for annotations only
    from proxy.config.sections import Alerts as AlertsSettings, AlertsWebhooks

QUEUE_SIZE = 1000  # notices waiting for delivery; past it the oldest is dropped (and counted)
_TIMEOUT = aiohttp.ClientTimeout(total=10)


@dataclass(frozen=True, slots=True)
class Condition:
    """Something wrong now: `key` names it (one alert per key), `kind` its rule."""

    key: str
    kind: str  # budget | balance | worker_ejected | no_worker | ledger_fault | spool_backlog | redis_down
    summary: str
    details: dict[str, Any] = field(default_factory=dict)
    severity: str = "warning"  # warning | critical


@dataclass(frozen=True, slots=True)
class Notice:
    state: str  # firing | reminder | resolved
    condition: Condition
    at: float

    def as_json(self) -> dict[str, Any]:
        c = self.condition
        return {"state": self.state, "kind": c.kind, "key": c.key, "severity": c.severity, "summary": c.summary,
                "details": c.details, "at": self.at}


class AlertBook:
    """The conditions that fired and when each was last told (sans-I/O)."""

    def __init__(self, reminder_s: float) -> None:
        self.reminder_s = reminder_s
        self.active: dict[str, tuple[Condition, float]] = {}  # key -> (the condition, when last told)

    def update(self, conditions: list[Condition], now: float) -> list[Notice]:
        notices: list[Notice] = []
        seen = set()
        for condition in conditions:
            seen.add(condition.key)
            told = self.active.get(condition.key)
            if told is None:
                notices.append(Notice("firing", condition, now))
                self.active[condition.key] = (condition, now)
            elif now - told[1] >= self.reminder_s:
                notices.append(Notice("reminder", condition, now))
                self.active[condition.key] = (condition, now)
        for key in [k for k in self.active if k not in seen]:
            condition, _ = self.active.pop(key)
            if condition.kind != "budget":  # a budget's crossing ends with its period: nothing to tell
                notices.append(Notice("resolved", condition, now))
        return notices


# ---------------------------------------------------------------------------------- what is wrong


def _period(now: float, which: str) -> str:
    t = time.gmtime(now)
    return time.strftime("%Y-%m-%d" if which == "daily" else "%Y-%m", t)


async def key_conditions(ledger: Any, section: AlertsSettings, now: float) -> list[Condition]:
    """Budgets past a threshold and balances under the floor, of every unrevoked key."""
    from proxy.ledger.service import period_starts

    found: list[Condition] = []
    day, month = period_starts(now)
    for record in await ledger.list_keys():
        if record.revoked or record.expired(now):
            continue
        if section.balance_below_micros is not None and record.balance_micros < section.balance_below_micros:
            found.append(Condition(f"balance:{record.key_id}", "balance",
                                   f"key {record.name} ({record.key_id}): balance {record.balance_micros} micros, "
                                   f"under {section.balance_below_micros}",
                                   {"key_id": record.key_id, "balance_micros": record.balance_micros}))
        for which, budget, since in (("daily", record.daily_budget_micros, day),
                                     ("monthly", record.monthly_budget_micros, month)):
            if not budget:
                continue
            spent = await ledger.spend_since(record.key_id, since)
            crossed = [t for t in section.budget_thresholds if spent >= budget * t]
            if crossed:
                threshold = max(crossed)
                found.append(Condition(
                    f"budget:{record.key_id}:{which}:{_period(now, which)}:{threshold:g}", "budget",
                    f"key {record.name} ({record.key_id}): {spent / budget:.0%} of its {which} budget spent",
                    {"key_id": record.key_id, "period": which, "spent_micros": spent, "budget_micros": budget,
                     "threshold": threshold}, "critical" if threshold >= 1 else "warning"))
    return found


async def level_conditions(ledger: Any, section: AlertsSettings, now: float) -> list[Condition]:
    """The same for organisations, teams and users (proxy/ledger/levels.py): a level's budget
    past a threshold in its period (keyed by the period's end, so the next period arms it
    again), a level's balance under the floor."""
    from proxy.ledger.levels import period_bounds

    found: list[Condition] = []
    for level in await ledger.list_levels():
        what = f"{level.kind} {level.name} ({level.level_id})"
        if (section.balance_below_micros is not None and level.balance_micros is not None
                and level.balance_micros < section.balance_below_micros):
            found.append(Condition(
                f"balance:{level.level_id}", "balance",
                f"{what}: balance {level.balance_micros} micros, under {section.balance_below_micros}",
                {level.kind + "_id": level.level_id, "balance_micros": level.balance_micros}))
        if not level.budget_micros or level.budget_period is None:
            continue
        spent = level.spent(now)
        crossed = [t for t in section.budget_thresholds if spent >= level.budget_micros * t]
        if crossed:
            threshold = max(crossed)
            _, end = period_bounds(level.budget_period, level.budget_reset, now)
            found.append(Condition(
                f"budget:{level.level_id}:{level.budget_period}:{end:.0f}:{threshold:g}", "budget",
                f"{what}: {spent / level.budget_micros:.0%} of its {level.budget_period} budget spent",
                {level.kind + "_id": level.level_id, "period": level.budget_period, "spent_micros": spent,
                 "budget_micros": level.budget_micros, "threshold": threshold},
                "critical" if threshold >= 1 else "warning"))
    return found


def pool_conditions(pool: Any) -> list[Condition]:
    found = [Condition(f"worker_ejected:{w.name}", "worker_ejected", f"worker {w.name} is ejected",
                       {"worker": w.name}) for w in pool.workers if w.ejected]
    for model in sorted(pool.models()):
        if not any(w.available and w.serves(model) for w in pool.workers):
            found.append(Condition(f"no_worker:{model}", "no_worker", f"no worker serves {model}",
                                   {"model": model}, "critical"))
    return found


def ledger_conditions(ledger: Any, section: AlertsSettings) -> list[Condition]:
    found = []
    fault = getattr(ledger, "fault", None) or getattr(ledger, "spool_fault", None)
    if fault:
        found.append(Condition("ledger_fault", "ledger_fault", f"the ledger is in a fault state: {fault}",
                               {"cause": str(fault)}, "critical"))
    spool = getattr(ledger, "spool", None)
    path = getattr(spool, "path", None)
    if path is not None:
        try:
            size = path.stat().st_size
        except OSError:
            size = 0
        if size > section.spool_backlog_bytes:
            found.append(Condition("spool_backlog", "spool_backlog",
                                   f"the settlement spool holds {size} bytes waiting for the ledger",
                                   {"bytes": size}))
    return found


def limits_conditions(counter: Any) -> list[Condition]:
    """The shared limits counter (limits.backend: redis) unreachable."""
    if counter is not None and counter.down:
        return [Condition("redis_down", "redis_down", "the Redis limits backend does not answer",
                          severity="critical")]
    return []


# ---------------------------------------------------------------------------------- delivery


def body_of(hook: AlertsWebhooks, notice: Notice) -> bytes:
    if hook.format == "slack":
        c = notice.condition
        mark = {"firing": ":rotating_light:", "reminder": ":hourglass:", "resolved": ":white_check_mark:"}[notice.state]
        return orjson.dumps({"text": f"{mark} responses-proxy {notice.state}: {c.summary}"})
    return orjson.dumps(notice.as_json())


def signature(secret: str, timestamp: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


class AlertCenter:
    """The rules' state, the queue and its sender, the counts."""

    def __init__(self, section: AlertsSettings, clock: Callable[[], float] = time.time) -> None:
        self.section = section
        self.book = AlertBook(section.reminder_s)
        self.clock = clock
        # one queue and one sender per webhook: a dead one never holds the others' notices back
        self.queues: dict[str, deque[Notice]] = {hook.name: deque(maxlen=QUEUE_SIZE) for hook in section.webhooks}
        self.wakes: dict[str, asyncio.Event] = {hook.name: asyncio.Event() for hook in section.webhooks}
        self.sent: dict[str, int] = {}
        self.failed: dict[str, int] = {}
        self.dropped = 0
        self.recent: deque[dict[str, Any]] = deque(maxlen=100)
        self.checks = 0  # checks made (a test can wait for some to pass)

    def enqueue(self, notices: list[Notice]) -> None:
        for notice in notices:
            self.recent.appendleft(notice.as_json())
            log.warning("alert", state=notice.state, kind=notice.condition.kind, summary=notice.condition.summary)
            for hook in self.section.webhooks:
                queue = self.queues[hook.name]
                if len(queue) == queue.maxlen:  # the oldest is dropped: never delivered, so counted as failed
                    self.dropped += 1
                    self.failed[hook.name] = self.failed.get(hook.name, 0) + 1
                queue.append(notice)
                self.wakes[hook.name].set()

    async def check(self, app: web.Application) -> list[Notice]:
        from proxy import state
        from proxy.limits.redis_backend import SHARED_COUNTER
        from proxy.upstream.health import READINESS

        now = self.clock()
        conditions = pool_conditions(app[state.POOL])
        ledger = app.get(state.LEDGER)
        if ledger is not None:
            conditions += ledger_conditions(ledger, self.section)
            readiness = app.get(READINESS)
            cause = await readiness.ledger_problem(app) if readiness is not None else None
            if cause is not None and not any(c.key == "ledger_fault" for c in conditions):
                # unreachable (a database stopped, a network cut): what /readyz says, told like a fault
                conditions.append(Condition("ledger_fault", "ledger_fault", f"the ledger does not answer: {cause}",
                                            {"cause": cause}, "critical"))
            try:
                conditions += await key_conditions(ledger, self.section, now)
                conditions += await level_conditions(ledger, self.section, now)
            except Exception as exc:  # a ledger away: its fault is the condition, not a crash here
                log.info("alerts: the keys could not be read", error=f"{type(exc).__name__}: {exc}")
        conditions += limits_conditions(app.get(SHARED_COUNTER))
        notices = self.book.update(conditions, now)
        self.enqueue(notices)
        self.checks += 1
        return notices

    async def deliver(self, session: aiohttp.ClientSession, hook: AlertsWebhooks, notice: Notice) -> bool:
        body = body_of(hook, notice)
        delay = self.section.backoff_s
        for attempt in range(self.section.retries + 1):
            stamp = str(int(self.clock()))
            headers = {"Content-Type": "application/json", "User-Agent": "responses-proxy-alerts"}
            if hook.secret:
                headers["X-Responses-Proxy-Timestamp"] = stamp
                headers["X-Responses-Proxy-Signature"] = signature(hook.secret, stamp, body)
            try:
                async with session.post(hook.url, data=body, headers=headers, timeout=_TIMEOUT) as answer:
                    if 200 <= answer.status < 300:
                        self.sent[hook.name] = self.sent.get(hook.name, 0) + 1
                        return True
                    retry = answer.status >= 500 or answer.status == 429
            except (aiohttp.ClientError, TimeoutError):
                retry = True
            if not retry or attempt == self.section.retries:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.section.max_backoff_s)
        self.failed[hook.name] = self.failed.get(hook.name, 0) + 1
        log.warning("alert not delivered", webhook=hook.name, kind=notice.condition.kind)
        return False

    async def sender(self, session: aiohttp.ClientSession, hook: AlertsWebhooks) -> None:
        queue, wake = self.queues[hook.name], self.wakes[hook.name]
        while True:
            while not queue:
                wake.clear()
                await wake.wait()
            await self.deliver(session, hook, queue.popleft())

    def view(self) -> dict[str, Any]:
        """What the console shows: the active conditions, the last notices, the counts."""
        return {"active": [{"key": c.key, "kind": c.kind, "summary": c.summary, "severity": c.severity,
                            "since_told": told} for c, told in self.book.active.values()],
                "recent": list(self.recent), "sent": dict(self.sent), "failed": dict(self.failed),
                "dropped": self.dropped, "queued": sum(len(q) for q in self.queues.values())}


class AlertsCollector:
    """/metrics: notices delivered and not, by webhook (this process's)."""

    def __init__(self, alerts: AlertCenter) -> None:
        self.alerts = alerts

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        sent = CounterMetricFamily("responses_proxy_alerts_sent", "Alert notices delivered, by webhook.",
                                   labels=["webhook"])
        failed = CounterMetricFamily("responses_proxy_alerts_failed",
                                     "Alert notices not delivered: given up after every retry, or dropped from a "
                                     "full queue; by webhook.",
                                     labels=["webhook"])
        for hook in self.alerts.section.webhooks:
            sent.add_metric([hook.name], self.alerts.sent.get(hook.name, 0))
            failed.add_metric([hook.name], self.alerts.failed.get(hook.name, 0))
        yield sent
        yield failed


ALERTS = web.AppKey("alerts", AlertCenter)


def alerts_context(section: AlertsSettings, session_key: Any) -> Callable[[web.Application], AsyncIterator[None]]:
    """The cleanup context: the checker and the sender, both off the request path."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        from proxy.runtime.metrics import METRICS

        alerts = app[ALERTS] = AlertCenter(section)
        metrics = app.get(METRICS)
        if metrics is not None:
            metrics.registry.register(AlertsCollector(alerts))

        async def checker() -> None:
            while True:
                await asyncio.sleep(section.check_interval_s)
                try:
                    await alerts.check(app)
                except Exception:  # alerts must never stop the process
                    log.exception("alerts: a check failed")

        tasks = [asyncio.create_task(checker())]
        tasks += [asyncio.create_task(alerts.sender(app[session_key], hook)) for hook in section.webhooks]
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    return ctx
