"""Units of work and the phases each one runs: the one place that says which checks apply where.

A unit is what the edge does for a client once: an HTTP request to a route, one WebSocket
`response.create` (a generation or a `generate: false` warm-up), the summary turn of a
compaction. The route table (proxy.http.routes) gives every HTTP route its unit and the
transports give their turns theirs (proxy.http.turn.Turn.unit); the envelope puts it on the
request's context (`ctx.unit`) and runs that unit's chain (middlewares.Phases), built once at
start-up from the phases the unit declares here: a phase not declared is not in the chain, so
no phase asks which unit it serves and no phase keeps a list of paths. A new route or message
type runs exactly what its unit declares, and tests/http/test_units.py sends each unit every
phase's refusal to prove it.

The phases, in their fixed order (middlewares/__init__.py):

  auth       the key from the headers; a revoked key stops (each turn of a socket too)
  limits     concurrency and rate, before a byte of the body is read or parsed
  body       the body read (or a turn's message decoded) within the unit's `body_limit`
  sizes      input items and tools counted against server.max_input_items / max_tools
  models     the key's allowed models
  translate  the stateless and tool policies, then the one Translation and the image guard
  balance    the hold (and the output cap lowered to it), settled after the handler

A unit whose work is decided by its body (a socket message is a generation or a warm-up) has
`variants`: the body phase picks one, and a variant must run the same phases before the body
as the unit it refines (checked below at import), since those ran before anyone knew.
"""

from __future__ import annotations

from typing import NamedTuple

AUTH = "auth"
LIMITS = "limits"
BODY = "body"
SIZES = "sizes"
MODELS = "models"
TRANSLATE = "translate"
BALANCE = "balance"
ORDER = (AUTH, LIMITS, BODY, SIZES, MODELS, TRANSLATE, BALANCE)
BEFORE_BODY = frozenset({AUTH, LIMITS})

EVERY = frozenset(ORDER)
UNBILLED = EVERY - {BALANCE}
NONE: frozenset[str] = frozenset()

# The body bounds a unit may name (server settings): work nobody pays for gets the smaller one.
BILLED_BODY = "max_body_bytes"
UNBILLED_BODY = "max_unbilled_body_bytes"


class Unit(NamedTuple):
    name: str
    phases: frozenset[str]
    body_limit: str = BILLED_BODY
    variants: tuple[Unit, ...] = ()
    why: str = ""  # the reason for each phase it skips: the table is read by people too
    # The pass-through families (proxy.http.passthrough_handler): the body goes upstream as sent; the
    # translate phase builds a Passthrough instead of a Translation, and runs none of the
    # Responses-only policies (stateless refusals, hosted tools) there. "": a Responses unit.
    family: str = ""
    items: str = "input"  # the body's list counted against server.max_input_items (sizes)
    # A refusal for money (402 insufficient_quota) of an event-stream-only client is answered
    # as response.created + response.failed (Codex reads a spent balance only so): Responses'.
    refusal_as_event: bool = False
    # A variant its translation asks for: the input ended with a compaction_trigger item, so
    # the request is answered with the sealed summary (proxy.http.compaction_trigger), the
    # same phases as the unit (the route table names the handler: proxy.http.routes.VARIANTS).
    compaction: bool = False

    def runs(self, phase: str) -> bool:
        return phase in self.phases

    def with_compaction(self) -> Unit:
        """This unit, its compaction_trigger variant declared."""
        trigger = self._replace(name=f"{self.name}, a compaction_trigger", variants=(), compaction=True)
        return self._replace(variants=(*self.variants, trigger))

    def compaction_variant(self) -> Unit | None:
        return next((variant for variant in self.variants if variant.compaction), None)


RESPONSES = Unit("POST /v1/responses", EVERY, refusal_as_event=True).with_compaction()
INPUT_TOKENS = Unit("POST /v1/responses/input_tokens", UNBILLED, body_limit=UNBILLED_BODY,
                    why="a count is free of charge; limited, and bounded by the unbilled body size")
COMPACT = Unit("POST /v1/responses/compact", frozenset({AUTH, LIMITS, BODY, SIZES, MODELS}),
               why="the handler keeps the latest user messages; the summary is its own turn (COMPACT_SUMMARY), "
                   "held and billed; a window with nothing to summarize costs nothing")
COMPACT_SUMMARY = Unit("compaction summary turn", EVERY - {LIMITS},
                       why="the request that runs it (a compaction, or a compaction_trigger's request asking "
                           "for its summary once more) took the concurrency slot and the rate token already"
                       ).with_compaction()
WS_WARMUP = Unit("WebSocket response.create generate=false", UNBILLED, body_limit=UNBILLED_BODY,
                 why="a warm-up calls no model: free of charge, limited, bounded by the unbilled body size")
WS_TURN = Unit("WebSocket response.create", EVERY, variants=(WS_WARMUP,)).with_compaction()
WS_HANDSHAKE = Unit("GET /v1/responses (WebSocket handshake)", frozenset({AUTH}),
                    why="each message is a unit of its own (WS_TURN); the socket itself is admitted "
                        "per key and in all by proxy.http.websocket")
KEYED = Unit("keyed read", frozenset({AUTH}), why="no body, no upstream call, nothing billed")
PUBLIC = Unit("public", NONE, why="probes, /metrics, the API description: no key (the admin console has its own)")
# The other APIs of the same model servers (proxy.http.passthrough_handler): every phase, but the
# translate phase is theirs (the key's model resolved, the body checked for what billing needs,
# the image guard on chat content); the Responses-only policies (stateless refusals, hosted
# tools) do not apply: these APIs have no previous_response_id, store or hosted tools.
CHAT = Unit("POST /v1/chat/completions", EVERY, family="chat", items="messages")
COMPLETIONS = Unit("POST /v1/completions", EVERY, family="completions", items="prompt")
EMBEDDINGS = Unit("POST /v1/embeddings", EVERY, family="embeddings", items="input")
MESSAGES = Unit("POST /v1/messages", EVERY, family="messages", items="messages")
MESSAGES_COUNT = Unit("POST /v1/messages/count_tokens", UNBILLED, body_limit=UNBILLED_BODY, family="messages_count",
                      items="messages",
                      why="a count is free of charge; limited, and bounded by the unbilled body size")
PASSTHROUGH = (CHAT, COMPLETIONS, EMBEDDINGS, MESSAGES, MESSAGES_COUNT)
# Another method on Anthropic's paths (a GET /v1/messages): its refusal in Anthropic's envelope.
KEYED_ANTHROPIC = KEYED._replace(name="keyed read on Anthropic's routes", family="messages")
UNITS = (RESPONSES, INPUT_TOKENS, COMPACT, COMPACT_SUMMARY, WS_TURN, WS_WARMUP, WS_HANDSHAKE, KEYED, KEYED_ANTHROPIC,
         PUBLIC, *PASSTHROUGH)


def _check(units: tuple[Unit, ...]) -> None:
    names = [unit.name for unit in units] + [v.name for unit in units for v in unit.variants]
    if len(set(names)) != len(set(units) | {v for unit in units for v in unit.variants}):
        raise AssertionError("two units share a name (the chains are found by it)")
    for unit in units:
        if not unit.phases <= EVERY:
            raise AssertionError(f"{unit.name}: unknown phase(s) {sorted(unit.phases - EVERY)}")
        if unit.phases != EVERY and not unit.why:
            raise AssertionError(f"{unit.name} skips {sorted(EVERY - unit.phases)} without saying why")
        for variant in unit.variants:
            if variant.phases & BEFORE_BODY != unit.phases & BEFORE_BODY:
                raise AssertionError(f"{variant.name} must run {unit.name}'s phases before the body")
            if variant.compaction and variant.phases != unit.phases:
                raise AssertionError(f"{variant.name}: a compaction_trigger variant runs its unit's phases")


_check(UNITS)
