"""Micro-benchmark of the sans-I/O stream rewriter: CPU microseconds per upstream event.

    python -m bench.rewriter_micro                 # every stream fixture + a synthetic 100-delta stream
    python -m bench.rewriter_micro --seconds 2     # longer per cell (less noise)
    python -m bench.rewriter_micro --impl some.module   # A/B: another module with StreamRewriter/ResponseContext

Two feeding modes per stream:
  coalesced  the whole upstream body in one feed() (what bench-coalesced sends: 100 deltas in one write)
  per-event  one feed() per upstream SSE event (one chunk per write)
Each run is start() + the feeds + finish() on a fresh StreamRewriter; the time is
time.process_time() (CPU of this process), divided by the number of upstream `data:` events.
The best of several rounds is reported (the machine is shared; the minimum is the least noisy).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "vllm-0.32-cpu"

_WORDS = [" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", "."]


def synthetic(n: int = 100, *, reasoning: bool = False) -> bytes:
    """The shape of bench/fake_upstream.c's bench-coalesced answer (vLLM 0.32); with
    `reasoning`, the first half of the deltas are reasoning (vLLM's `reasoning` field)."""
    cid = "chatcmpl-0123456789abcdef"
    head = f'data: {{"id":"{cid}","object":"chat.completion.chunk","created":1795979497,"model":"bench",'
    parts = [head + '"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
             '"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}\n\n']
    for i in range(1, n + 1):
        fr = '"stop"' if i == n else "null"
        field = "reasoning" if reasoning and i <= n // 2 else "content"
        parts.append(head + f'"choices":[{{"index":0,"delta":{{"{field}":"{_WORDS[(i - 1) % 10]}"}},"logprobs":null,'
                     f'"finish_reason":{fr},"token_ids":null}}]}}\n\n')
    if reasoning:
        parts.append("data: [DONE]\n\n")
    else:
        parts.append(head + '"choices":[],"usage":{"prompt_tokens":28,"total_tokens":128,"completion_tokens":100,'
                     '"prompt_tokens_details":null,"completion_tokens_details":null}}\n\ndata: [DONE]\n\n')
    return "".join(parts).encode()


def split_events(body: bytes) -> list[bytes]:
    """The body cut after every blank line (one upstream event per piece)."""
    body = body.replace(b"\r\n", b"\n")
    pieces = [p + b"\n\n" for p in body.split(b"\n\n") if p.strip()]
    return pieces


def streams() -> dict[str, bytes]:
    out = {"synthetic-100": synthetic(), "synthetic-reasoning-100": synthetic(reasoning=True)}
    for path in sorted(FIX.glob("*_stream.body")):
        name = path.name[: -len(".body")]
        if name.startswith("anthropic"):
            continue  # not a chat-completions stream
        out[name] = path.read_bytes()
    return out


def measure(mod, body: bytes, per_event: bool, seconds: float, rounds: int) -> tuple[float, int]:
    """Best-of-rounds CPU us per upstream event, and the number of upstream events."""
    StreamRewriter, ResponseContext = mod.StreamRewriter, mod.ResponseContext
    ctx = ResponseContext(response_id="resp_" + "ab" * 12, model="bench", created_at=1_795_980_000,
                          echo={}, tools={})
    pieces = split_events(body)
    n_events = len(pieces)
    feeds = pieces if per_event else [body]

    def once() -> None:
        rw = StreamRewriter(ctx)
        rw.start()
        feed = rw.feed
        for p in feeds:
            feed(p)
        rw.finish()

    # calibrate: how many runs fill a round
    t0 = time.process_time()
    k = 0
    while time.process_time() - t0 < 0.05:
        once()
        k += 1
    per_round = max(1, int(k * (seconds / rounds) / 0.05))
    best = float("inf")
    gc_was = gc.isenabled()
    for _ in range(rounds):
        gc.collect()
        t0 = time.process_time()
        for _ in range(per_round):
            once()
        dt = time.process_time() - t0
        best = min(best, dt / per_round)
    if gc_was:
        gc.enable()
    return best * 1e6 / n_events, n_events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=1.0, help="CPU seconds per cell (default 1)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--impl", default="proxy.protocol.rewriter", help="module providing StreamRewriter, ResponseContext")
    ap.add_argument("--only", default="", help="substring filter on the stream name")
    args = ap.parse_args()
    mod = importlib.import_module(args.impl)
    print(f"rewriter: {args.impl}  (CPU us per upstream event, best of {args.rounds} rounds)")
    print("| stream | upstream events | bytes | coalesced us/event | per-event us/event |")
    print("|---|--:|--:|--:|--:|")
    for name, body in streams().items():
        if args.only and args.only not in name:
            continue
        co, n = measure(mod, body, False, args.seconds, args.rounds)
        pe, _ = measure(mod, body, True, args.seconds, args.rounds)
        print(f"| {name} | {n} | {len(body)} | {co:.2f} | {pe:.2f} |", flush=True)


if __name__ == "__main__":
    main()
