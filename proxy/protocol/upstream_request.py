"""What the forwarding code reads of a request, whichever API it came in on: the failover, the
context check, the affinity key, the token counter and the balance's hold take an
`UpstreamRequest`. A Responses request's Translation (proxy.protocol.translate) and a
pass-through request's Passthrough (proxy.protocol.passthrough) are both one, by their fields
alone (a Protocol: neither names it), so neither carries a field for the other's sake."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from proxy.protocol.prompt import PromptBound

_Self = TypeVar("_Self", bound="UpstreamRequest")


class UpstreamRequest(Protocol):
    @property
    def chat(self) -> dict:
        """The chat-shaped body (a pass-through's view of its prompt): what is counted and bounded."""

    @property
    def model(self) -> str:
        """As the client sent it."""

    @property
    def upstream_model(self) -> str:
        """The name the worker serves (proxy.protocol.models.resolve_model)."""

    @property
    def stream(self) -> bool: ...

    @property
    def max_output_tokens(self) -> int | None:
        """The cap asked for (None: the model's window)."""

    @property
    def reserved_output(self) -> int | None:
        """The cap per answer the hold was sized for (the balance sets it)."""

    @property
    def choices(self) -> int:
        """Answers generated, each up to the cap: the hold's output is cap x choices."""

    @property
    def prompt_cache_key(self) -> str | None: ...

    @property
    def conversation(self) -> str | None: ...

    @property
    def output_cap(self) -> int | None:
        """The most output deltas one answer may be sent (and billed)."""

    def prompt_bound(self) -> PromptBound:
        """The prompt's upper bound of tokens (proxy.protocol.prompt), computed once."""

    def with_max_tokens(self: _Self, max_tokens: int) -> _Self:
        """This request with `max_tokens` sent upstream (the context check's clamp)."""


__all__ = ["UpstreamRequest"]
