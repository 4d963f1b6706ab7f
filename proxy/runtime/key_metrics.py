"""Per-key spend and balance for Prometheus, with bounded cardinality.

    metrics:
      key_ids: [key_0123...]   # these keys, always (opt-in list)
      top_keys: 10             # and the 10 keys with the most spend this UTC month
      key_refresh_s: 15        # the figures are read from the ledger at most this often

Series (labels key_id and name; at most len(key_ids) + top_keys keys at a time):
  responses_proxy_key_balance_micros        the prepaid balance
  responses_proxy_key_spend_today_micros    debited since 00:00 UTC
  responses_proxy_key_spend_month_micros    debited since the 1st, 00:00 UTC

Read from the ledger at scrape time (a few indexed reads, cached for key_refresh_s), so
with serve --workers N every process reports the same shared figures.
"""

from __future__ import annotations

import time
from typing import cast

from aiohttp import web
from prometheus_client.core import GaugeMetricFamily

from proxy.ledger.interface import Ledger
from proxy.ledger.service import period_starts

PREFIX = "responses_proxy"


class KeyMetrics:
    """A prometheus_client collector of the chosen keys' figures, refreshed by `refresh`."""

    def __init__(self, key_ids: list[str], top_n: int, refresh_s: float) -> None:
        self.key_ids = list(dict.fromkeys(key_ids))
        self.top_n = int(top_n)
        self.refresh_s = float(refresh_s)
        self._rows: list[tuple[str, str, int, int, int]] = []  # key_id, name, balance, today, month
        self._read_at = float("-inf")

    async def refresh(self, ledger: Ledger | None, now: float | None = None) -> None:
        if ledger is None or time.monotonic() - self._read_at < self.refresh_s:
            return
        try:
            self._rows = await self._read(ledger, now)
        except Exception:  # a scrape never fails because the ledger is busy
            return
        self._read_at = time.monotonic()

    async def _read(self, ledger: Ledger, now: float | None) -> list[tuple[str, str, int, int, int]]:
        day, month = period_starts(now)
        month_spend = {t.group["key"]: t.debited_micros for t in await ledger.usage_totals(("key",), since=month)}
        chosen = list(self.key_ids)
        if self.top_n:
            top = sorted(month_spend.items(), key=lambda kv: (-kv[1], kv[0]))[:self.top_n]
            chosen += [key for key, _ in top if key not in chosen]
        today = {t.group["key"]: t.debited_micros for t in await ledger.usage_totals(("key",), since=day)}
        rows = []
        for key_id in chosen:
            record = await ledger.get_key(key_id)
            if record is None:
                continue
            rows.append((key_id, record.name, record.balance_micros, today.get(key_id, 0), month_spend.get(key_id, 0)))
        return rows

    def collect(self):
        families = (
            (f"{PREFIX}_key_balance_micros", "Prepaid balance of the key (opt-in keys and top spenders).", 2),
            (f"{PREFIX}_key_spend_today_micros", "Debited from the key since 00:00 UTC.", 3),
            (f"{PREFIX}_key_spend_month_micros", "Debited from the key since the 1st of the month, 00:00 UTC.", 4),
        )
        for name, doc, column in families:
            family = GaugeMetricFamily(name, doc, labels=("key_id", "name"))
            for row in self._rows:
                family.add_metric((row[0], row[1]), cast(int, row[column]))  # one of the three sums
            yield family


KEY_METRICS = web.AppKey("key_metrics", KeyMetrics)  # the app's per-key figures (proxy.runtime.metrics)
