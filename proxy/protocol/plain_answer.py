"""The common non-stream answer, built directly: one choice, one text, no reasoning, no calls.

Nearly every non-stream completion is that shape, and running it through the assembler (its
message as one delta, through the item state machine with an encoder that writes nothing)
costs more than the rest of the answer's translation. `plain_response` builds the same
Response for it and answers None for anything else, which then takes the general path
(proxy.protocol.rewriter.completion_response). tests/protocol/test_rewriter_fastpath.py checks the
two give the same dict, key order included, over generated completions on both sides of
every condition below.
"""

from __future__ import annotations

from typing import Any

from proxy.protocol.assembler import INCOMPLETE_REASONS, message_item
from proxy.protocol.response import ResponseContext, base_response, client_usage, map_usage

# The finish reasons taken here, and the incomplete_details.reason each gives (None: completed);
# "abort" and the unknown ones take the general path.
_ENDS: dict[str, str | None] = {"stop": None, "tool_calls": None, **INCOMPLETE_REASONS}


def plain_response(ctx: ResponseContext, completion: Any) -> tuple[dict, dict] | None:
    """(the Response, the reported usage mapped) for a plain text completion; None otherwise."""
    if completion.__class__ is not dict or "error" in completion or completion.get("object") == "error":
        return None
    usage = completion.get("usage")
    choices = completion.get("choices")
    if usage.__class__ is not dict or choices.__class__ is not list or len(choices) != 1:
        return None
    choice = choices[0]
    if choice.__class__ is not dict or (choice.get("index") or 0) != 0:
        return None
    msg = choice.get("message")
    if msg.__class__ is not dict:
        return None
    text = msg.get("content")
    # Reasoning or calls open items of their own: the general path's job.
    if (text.__class__ is not str or not text or msg.get("reasoning") is not None
            or msg.get("reasoning_content") is not None or msg.get("tool_calls")):
        return None
    reason = choice.get("finish_reason") or "stop"
    if reason.__class__ is not str or reason not in _ENDS:
        return None
    cap = ctx.output_cap
    if cap is not None and cap < 0:
        cap = None
    if cap == 0:  # the one text is already past the cap: the general path cuts it
        return None
    incomplete = _ENDS[reason]
    status = "completed" if incomplete is None else "incomplete"
    item = message_item("msg_" + ctx.ids(), status, text)
    reported = map_usage(usage)
    r = base_response(ctx)
    r["status"] = status
    r["output"] = [item]
    r["usage"] = client_usage(reported, cap)
    r["incomplete_details"] = None if incomplete is None else {"reason": incomplete}
    r["error"] = None
    if incomplete is None:
        r["completed_at"] = ctx.clock()
    return r, reported
