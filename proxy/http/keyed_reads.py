"""The keyed reads (the unit KEYED: auth, nothing else): GET /v1/models, the models the
workers serve with their windows, and GET /v1/key, the caller's own key, modelled on
OpenRouter's key endpoint: its balance, its limits, its spend today and this month (UTC
periods, the budgets' own), and nothing about any other key. Money in integer micro-units,
with the same figures in currency units beside them."""

from __future__ import annotations

import time

import orjson
from aiohttp import web

from proxy import state
from proxy.errors import APIError
from proxy.ledger.base import is_static
from proxy.ledger.service import iso, key_summary

_UNIT = 1_000_000
_STARTED = int(time.time())


def _units(micros: int | None) -> float | None:
    return None if micros is None else micros / _UNIT


async def key_handler(request: web.Request) -> web.Response:
    record = state.context(request).key
    if record is None:  # auth switched off: there is no caller's key to describe
        raise APIError(404, "This proxy runs without API keys: there is no key to describe.", code="no_api_keys")
    ledger = request.app.get(state.LEDGER)
    limits = {
        "allowed_models": list(record.allowed_models) if record.allowed_models is not None else None,
        "concurrency": record.concurrency, "rate_per_min": record.rate_per_min,
        "tokens_per_min": record.tokens_per_min,
        "daily_budget_micros": record.daily_budget_micros, "monthly_budget_micros": record.monthly_budget_micros,
    }
    data = {"label": record.name, "key_id": record.key_id, "prefix": record.prefix, "is_free_tier": False,
            "created": iso(record.created_at) if record.created_at else None,
            "expires_at": record.expires_at, "expires": iso(record.expires_at), "limits": limits}
    if is_static(record) or ledger is None:
        data.update({"billed": False, "balance_micros": None, "limit_remaining": None})
    else:
        fresh = await ledger.get_key(record.key_id) or record  # the cached record's balance may be old
        summary = await key_summary(ledger, fresh)
        data.update({"billed": True, **summary,
                     "limit_remaining": _units(summary["available_micros"]),
                     "usage_daily": _units(summary["spend_today_micros"]),
                     "usage_monthly": _units(summary["spend_month_micros"]),
                     "balance": _units(summary["balance_micros"])})
    return web.Response(body=orjson.dumps({"data": data}), content_type="application/json",
                        headers={"Cache-Control": "no-store"})


async def models_handler(request: web.Request) -> web.Response:
    data = []
    for model, window in sorted(request.app[state.POOL].models().items()):
        entry = {"id": model, "object": "model", "created": _STARTED, "owned_by": "responses-proxy"}
        if window:
            entry["context_window"] = window
            entry["max_model_len"] = window
        data.append(entry)
    return web.Response(body=orjson.dumps({"object": "list", "data": data}), content_type="application/json")
