"""Which worker takes a request: the `provider` object, eligibility, prompt-cache affinity
(proxy.upstream.affinity) or the least-loaded choice, and the pre-flight context-window check.

The `provider` object (000 doc, "worker requirements") is modelled on OpenRouter's
provider preferences; the README's "Provider requirements" section lists what each
field does here. Selection is pure (no I/O). The context check's upper bound is the prompt's
one (proxy.protocol.prompt.prompt_bound); only when it says the prompt may not fit does the
check ask the worker's tokenizer (proxy.upstream.tokens), its only upstream call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp

from proxy.errors import APIError, bad_request
from proxy.upstream.affinity import pick as pick_by_affinity, pick_on_route, request_key
from proxy.upstream.tokens import TokenCounter

if TYPE_CHECKING:
    from proxy.config.sections import Routing
    from proxy.protocol.upstream_request import UpstreamRequest
    from proxy.upstream.affinity import AffinityKey
    from proxy.upstream.workers import Route, Worker, WorkerPool

    _R = TypeVar("_R", bound=UpstreamRequest)  # the request checked, and the copy it answers

SORTS = ("load", "latency", "price")
SORT_ALIASES = {"throughput": "load"}  # OpenRouter's "throughput": the least loaded worker has the most to give
FIELDS = ("order", "only", "ignore", "quantizations", "allow_fallbacks", "sort", "max_price",
          "data_collection", "zdr", "require_parameters", "labels")
PARAMETERS = ("tools", "json_schema", "json_object")


# --------------------------------------------------------------------------- the provider object


@dataclass
class ProviderPrefs:
    order: list[str] | None = None
    only: list[str] | None = None
    ignore: list[str] | None = None
    quantizations: list[str] | None = None
    allow_fallbacks: bool = True
    sort: str = "load"
    max_price: dict[str, float] | None = None
    data_collection: str | None = None  # "allow" | "deny"
    zdr: bool | None = None
    require_parameters: bool = False
    labels: dict[str, Any] = field(default_factory=dict)

    @property
    def single_attempt(self) -> bool:
        """allow_fallbacks: false with no order: only the first choice, no failover."""
        return not self.allow_fallbacks and not self.order


def _invalid(message: str) -> APIError:
    return bad_request(message, param="provider", code="invalid_provider")


def _names(raw: dict, key: str) -> list[str] | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise _invalid(f"Invalid 'provider.{key}': expected an array of non-empty strings.")
    return [v.strip() for v in value]


def _bool(raw: dict, key: str) -> bool | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, bool):
        raise _invalid(f"Invalid 'provider.{key}': expected a boolean.")
    return value


def _scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool)) and not (isinstance(value, float) and math.isnan(value))


def parse_provider(raw: Any) -> ProviderPrefs | None:
    """The request's `provider` object, validated; a bad shape is a 400 with param "provider"."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise _invalid("Invalid type for 'provider': expected an object.")
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise _invalid(f"Unsupported field(s) in 'provider': {', '.join(unknown)}. "
                       f"Supported: {', '.join(FIELDS)}.")
    prefs = ProviderPrefs(order=_names(raw, "order"), only=_names(raw, "only"), ignore=_names(raw, "ignore"),
                          quantizations=_names(raw, "quantizations"))
    fallbacks = _bool(raw, "allow_fallbacks")
    prefs.allow_fallbacks = True if fallbacks is None else fallbacks
    prefs.zdr = _bool(raw, "zdr")
    prefs.require_parameters = bool(_bool(raw, "require_parameters"))
    sort = raw.get("sort")
    if sort is not None:
        if not isinstance(sort, str) or SORT_ALIASES.get(sort, sort) not in SORTS:
            raise _invalid(f"Invalid 'provider.sort': expected one of {', '.join(SORTS + tuple(SORT_ALIASES))}.")
        prefs.sort = SORT_ALIASES.get(sort, sort)
    max_price = raw.get("max_price")
    if max_price is not None:
        if (not isinstance(max_price, dict) or not max_price or set(max_price) - {"prompt", "completion"}
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                           for v in max_price.values())):
            raise _invalid("Invalid 'provider.max_price': expected an object with 'prompt' and/or 'completion', "
                           "non-negative prices per million tokens.")
        prefs.max_price = {k: float(v) for k, v in max_price.items()}
    data_collection = raw.get("data_collection")
    if data_collection is not None:
        if data_collection not in ("allow", "deny"):
            raise _invalid("Invalid 'provider.data_collection': expected 'allow' or 'deny'.")
        prefs.data_collection = data_collection
    labels = raw.get("labels")
    if labels is not None:
        if not isinstance(labels, dict) or not all(
                isinstance(k, str) and (_scalar(v) or (isinstance(v, list) and v and all(map(_scalar, v))))
                for k, v in labels.items()):
            raise _invalid("Invalid 'provider.labels': expected an object of label -> value "
                           "(a string, number or boolean, or an array of them: any of).")
        prefs.labels = dict(labels)
    return prefs


_NO_PARAMETERS: frozenset[str] = frozenset()


def request_parameters(chat: dict) -> frozenset[str]:
    """What `require_parameters` asks the worker to support, from the chat request."""
    if not chat.get("tools") and chat.get("response_format") is None:
        return _NO_PARAMETERS  # the common request: no set to build
    found = set()
    if chat.get("tools"):
        found.add("tools")
    fmt = chat.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_schema", "json_object"):
        found.add(fmt["type"])
    return frozenset(found)


# --------------------------------------------------------------------------- matching workers


def _norm(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip().lower()


def _label_values(worker: Worker, key: str) -> set[str]:
    value = worker.labels.get(key)
    if value is None:
        return set()
    if isinstance(value, list):
        return {_norm(v) for v in value}
    if key == "supports" and isinstance(value, str):
        return {_norm(v) for v in value.split(",") if v.strip()}
    return {_norm(value)}


def matches(worker: Worker, entry: str) -> bool:
    """An order/only/ignore entry: the worker's name, `key=value` on a label, or any label's value."""
    wanted = entry.strip().lower()
    if wanted == worker.name.lower():
        return True
    if "=" in wanted:
        key, _, value = entry.partition("=")
        return _norm(value) in _label_values(worker, key.strip())
    return any(wanted in _label_values(worker, key) for key in worker.labels)


def _truthy(worker: Worker, key: str) -> bool:
    return _label_values(worker, key) & {"true", "1", "yes"} != set()


def _price(worker: Worker, key: str) -> float | None:
    value = worker.labels.get(key)
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.inf  # a price label that is not a number never passes a max_price


def _within_price(worker: Worker, limits: dict[str, float]) -> bool:
    for part, limit in limits.items():
        price = _price(worker, f"price_{part}")
        if price is not None and price > limit:
            return False
    return True


def _supports(worker: Worker, params: frozenset[str]) -> bool:
    supported = _label_values(worker, "supports")
    for param in params:
        if param == "json_object":
            if not supported & {"json_object", "json_schema"}:
                return False
        elif param not in supported:
            return False
    return True


def _labels_match(worker: Worker, labels: dict[str, Any]) -> bool:
    for key, value in labels.items():
        wanted = {_norm(v) for v in value} if isinstance(value, list) else {_norm(value)}
        if not wanted & _label_values(worker, key):
            return False
    return True


def requirements(prefs: ProviderPrefs, params: frozenset[str]) -> list[tuple[str, Callable[[Worker], bool]]]:
    """(how the failure is named, predicate) for each requirement the request sets, in order."""
    out: list[tuple[str, Callable[[Worker], bool]]] = []
    if prefs.only is not None:
        only = prefs.only
        out.append((f"provider.only={only!r}", lambda w: any(matches(w, e) for e in only)))
    if prefs.ignore:
        ignore = prefs.ignore
        out.append((f"provider.ignore={ignore!r}", lambda w: not any(matches(w, e) for e in ignore)))
    if prefs.quantizations is not None:
        quants = {q.lower() for q in prefs.quantizations}
        out.append((f"provider.quantizations={prefs.quantizations!r}",
                    lambda w: bool(_label_values(w, "quantization") & quants)))
    if prefs.max_price is not None:
        limits = prefs.max_price
        out.append((f"provider.max_price={limits!r}", lambda w: _within_price(w, limits)))
    if prefs.data_collection == "deny":
        out.append(("provider.data_collection='deny'",
                    lambda w: "deny" in _label_values(w, "data_collection") or _truthy(w, "zdr")))
    if prefs.zdr:
        out.append(("provider.zdr=true", lambda w: _truthy(w, "zdr")))
    if prefs.require_parameters and params:
        out.append((f"provider.require_parameters=true (the request uses {', '.join(sorted(params))})",
                    lambda w: _supports(w, params)))
    if prefs.labels:
        labels = prefs.labels
        out.append((f"provider.labels={labels!r}", lambda w: _labels_match(w, labels)))
    if prefs.order and not prefs.allow_fallbacks:
        order = prefs.order
        out.append((f"provider.order={order!r} with allow_fallbacks=false",
                    lambda w: any(matches(w, e) for e in order)))
    return out


def tiers(prefs: ProviderPrefs | None, workers: list[Worker]) -> list[list[Worker]]:
    """Workers in the order `provider.order` names them; the rest last (when fallbacks are allowed)."""
    if prefs is None or not prefs.order:
        return [workers]
    out: list[list[Worker]] = []
    placed: set[int] = set()
    for entry in prefs.order:
        tier = [w for w in workers if id(w) not in placed and matches(w, entry)]
        placed.update(map(id, tier))
        if tier:
            out.append(tier)
    if prefs.allow_fallbacks:
        rest = [w for w in workers if id(w) not in placed]
        if rest:
            out.append(rest)
    return out


def _sort_key(sort: str) -> Callable[[Worker], Any]:
    if sort == "latency":
        # No sample yet counts as fastest, so a new or re-admitted worker gets measured.
        return lambda w: (w.ewma_ttfb or 0.0, w.load)
    if sort == "price":
        def price(w: Worker) -> tuple[float, float]:
            parts = [_price(w, "price_prompt"), _price(w, "price_completion")]
            known = [p for p in parts if p is not None]
            return (sum(known) if known else math.inf, w.load)
        return price
    return lambda w: w.load


def _best(workers: list[Worker], sort: str, rotation: int) -> Worker:
    if len(workers) == 1:
        return workers[0]
    start = rotation % len(workers)
    rotated = workers[start:] + workers[:start]  # ties go round-robin
    return min(rotated, key=_sort_key(sort))


def choose(pool: WorkerPool, model: str, exclude: Iterable[Worker] = (), prefs: ProviderPrefs | None = None,
           params: frozenset[str] = frozenset(), need_capacity: bool = True,
           affinity: AffinityKey | None = None) -> Worker:
    """The worker for one attempt of a request, after re-admitting workers whose ejection is over."""
    pool.readmit_due()
    return select(pool, model, prefs, exclude=exclude, params=params, need_capacity=need_capacity,
                  affinity=affinity)


def select(pool: WorkerPool, model: str, prefs: ProviderPrefs | None, *, exclude: Iterable[Worker] = (),
           params: frozenset[str] = frozenset(), need_capacity: bool = True,
           affinity: AffinityKey | None = None) -> Worker:
    """The worker for one attempt. With an affinity key (proxy.upstream.affinity) and the default `load`
    sort, the choice within the first tier with room is the key's worker on the bounded-load
    ring of that tier's eligible workers; otherwise the best by `sort`."""
    route = pool.route(model)
    if prefs is None and route.available and not exclude:
        return _select_plain(pool, route, model, need_capacity, affinity)
    candidates = route.serving
    if not candidates:
        pending = [w for w in pool.workers if not w.models_known]
        if pending:
            raise APIError(503, f"No worker is known to serve '{model}' yet: the model list of "
                                f"{', '.join(w.name for w in pending)} could not be read.",
                           code="no_worker_available", headers={"Retry-After": pool.retry_after(pending)})
        raise APIError(404, f"The model '{model}' does not exist or is not served here.",
                       code="model_not_found", param="model")
    if prefs is not None:
        for label, keep in requirements(prefs, params):
            kept = [w for w in candidates if keep(w)]
            if not kept:
                raise APIError(503, f"No worker meets {label} for model '{model}'.",
                               code="provider_requirements_unmet", param="provider")
            candidates = kept
    excluded = set(map(id, exclude))
    usable = route.available_ids  # available, or in panic the ejected ones the checks pass
    healthy = [[w for w in tier if id(w) in usable] for tier in tiers(prefs, candidates)]
    ranked = [[w for w in tier if id(w) not in excluded] for tier in healthy]
    if not any(ranked):
        # Retry-After: until the earliest of these workers can be back (ejection over, next check).
        waiting = [w for w in candidates if id(w) not in excluded]
        raise APIError(503, f"No healthy worker that meets the request's requirements serves '{model}' right now.",
                       code="no_worker_available", headers={"Retry-After": pool.retry_after(waiting)})
    sort = prefs.sort if prefs is not None else "load"
    rotation = pool.next_rotation()
    for eligible, tier in zip(healthy, ranked):
        free = [w for w in tier if w.in_flight < w.capacity] if need_capacity else tier
        if free:
            if affinity is not None and sort == "load":
                # The ring is over the tier's eligible workers before failover's exclusions, so a
                # retry continues on the same ring past the worker that failed.
                chosen = pick_by_affinity(pool, affinity, route.serving, eligible, excluded, need_capacity)
                if chosen is not None:
                    return chosen
            return _best(free, sort, rotation)
    raise _at_capacity(model)


def _select_plain(pool: WorkerPool, route: Route, model: str, need_capacity: bool,
                  affinity: AffinityKey | None) -> Worker:
    """select() for the common request: no provider object, nothing excluded and some worker
    available. One tier, the route's available workers, so the choice (and the rotation and
    affinity counters) is the general path's without rebuilding its lists."""
    rotation = pool.next_rotation()
    if affinity is not None:
        # Only a worker with room passes the walk: a choice here means `free` was not empty.
        chosen = pick_on_route(pool, affinity, route, need_capacity)
        if chosen is not None:
            return chosen
    eligible = route.available
    free = [w for w in eligible if w.in_flight < w.capacity] if need_capacity else eligible
    if not free:
        raise _at_capacity(model)
    return _best(free, "load", rotation)


def _at_capacity(model: str) -> APIError:
    return APIError(429, f"Every eligible worker serving '{model}' is at capacity; retry shortly.",
                    code="capacity_exhausted", headers={"Retry-After": "1"})


# --------------------------------------------------------------------------- the context window


def _too_long(window: int, prompt: int, wanted: int | None, *, estimated: bool) -> APIError:
    counted = f"at least {prompt} input tokens (estimated from its size)" if estimated else f"{prompt} input tokens"
    if wanted is None:
        message = (f"This model's maximum context length is {window} tokens, but the input has {counted}. "
                   "Shorten the input.")
        return APIError(400, message, code="context_length_exceeded", param="input")
    message = (f"This model's maximum context length is {window} tokens, but the request asks for {counted} "
               f"plus max_output_tokens={wanted} output tokens ({prompt + wanted} in total). Lower "
               "max_output_tokens or shorten the input.")
    return APIError(400, message, code="context_length_exceeded", param="max_output_tokens")


async def check_context_window(session: aiohttp.ClientSession, worker: Worker, t: _R, client_max: Any,
                               *, bytes_per_token_floor: float) -> tuple[str, _R]:
    """Refuse (400 context_length_exceeded) a request whose prompt + max_output_tokens cannot fit.

    Returns what was decided ("no_window", "fits", "counted", "clamped", ...) for tests and logs,
    and the Translation to send: `t` itself, or when clamped a copy with a lower max_tokens.
    The common case costs no upstream call: an upper bound from the prompt's size settles it.
    """
    window = worker.max_model_len.get(t.upstream_model)
    max_tokens = t.chat.get("max_tokens")
    if not window or max_tokens is None:
        return "no_window", t
    upper, text, media = t.prompt_bound()  # computed once with the translation
    if media:
        return "media", t  # image tokens are the model server's to count
    asked = isinstance(client_max, int) and not isinstance(client_max, bool)
    if not asked:
        # The client set no max_output_tokens: the cap is ours (the balance's, a summary's, the
        # default). vLLM lowers it to the room left by itself, but refuses one above the whole
        # window; SGLang refuses, so lower it here, from the bound, with no upstream call.
        if worker.dialect != "sglang":
            return ("fits", t) if max_tokens <= window else ("clamped", t.with_max_tokens(window))
        if upper + max_tokens <= window:
            return "fits", t
        if window - upper >= 1:
            return "clamped", t.with_max_tokens(window - upper)
    wanted = int(client_max) if asked else int(max_tokens)
    if upper + wanted <= window:
        return "fits", t
    lower = int(text / bytes_per_token_floor) if bytes_per_token_floor > 0 else 0
    if asked and lower + wanted > window:
        raise _too_long(window, lower, wanted, estimated=True)  # clearly over: no need to ask
    count = await TokenCounter(session).prompt(t, worker)
    if count is None:
        return "uncounted", t  # the model server will judge
    if count >= window:
        raise _too_long(window, count, wanted if asked else None, estimated=False)
    if asked and count + wanted > window:
        raise _too_long(window, count, wanted, estimated=False)
    if count + int(max_tokens) > window:
        return "clamped", t.with_max_tokens(window - count)
    return "counted", t


# --------------------------------------------------------------------------- one request's route


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """What a request asks of the workers, read once before the first is picked (both forwarding
    handlers' failover, proxy.http.failover): the client's provider preferences, the parameters a
    worker must then support, the prompt-cache affinity key, how many workers may try, and what
    the context check of the first one needs."""

    prefs: ProviderPrefs | None
    params: frozenset[str]
    affinity: AffinityKey | None
    attempts: int
    check: bool  # the context check runs on the first worker
    client_max: Any  # the client's own output cap (max_output_tokens), None when it set none
    bytes_per_token_floor: float


def route_plan(t: UpstreamRequest, settings: Routing, *, provider: Any = None, client_max: Any = None,
               check: bool = True) -> RoutePlan:
    """The plan of `t` under config.routing: `provider` is the request's own object (a bad shape is
    a 400 naming it), `check` whether its context may be checked at all (routing.context_check
    switches it off for every request)."""
    prefs = parse_provider(provider)
    attempts = 1 if prefs is not None and prefs.single_attempt else max(settings.max_attempts, 1)
    return RoutePlan(prefs, request_parameters(t.chat) if prefs is not None else _NO_PARAMETERS,
                     request_key(t, settings.affinity), attempts, check and settings.context_check,
                     client_max, settings.bytes_per_token_floor)


async def take(session: aiohttp.ClientSession, pool: WorkerPool, t: _R, plan: RoutePlan,
               tried: list[Worker]) -> tuple[Worker, _R]:
    """The next worker for `t` (none of `tried`) with one of its slots taken, and what to send it:
    on the first worker, the context check's answer (`t`, or a copy with a lower cap). The slot is
    taken before any await, so capacity is never over-committed; the caller gives it back
    (`worker.in_flight -= 1`) once the attempt ends. Raises APIError when no worker is left or the
    prompt cannot fit (the slot then given back here)."""
    worker = choose(pool, t.upstream_model, exclude=tried, prefs=plan.prefs, params=plan.params,
                    affinity=plan.affinity)
    worker.in_flight += 1
    if not plan.check or tried:
        return worker, t
    try:
        return worker, (await check_context_window(session, worker, t, plan.client_max,
                                                   bytes_per_token_floor=plan.bytes_per_token_floor))[1]
    except BaseException:
        worker.in_flight -= 1
        raise
