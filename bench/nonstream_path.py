"""Why non-stream requests use the upstream's non-stream call: measured, not assumed.

    .venv/bin/python -m bench.nonstream_path
    .venv/bin/python -m bench.nonstream_path --impl some.module   # A/B: another rewriter module

Builds the same Response two ways from the captured vLLM answer (final_chat): from the
non-stream chat.completion body, and by running its stream through the StreamRewriter.
Each figure is the best of several rounds of CPU time (time.process_time): the machine is
shared, and the minimum is the least noisy.
"""

from __future__ import annotations

import argparse
import importlib
import time
from pathlib import Path

import orjson

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "vllm-0.32-cpu"


def _best(run, n: int, rounds: int) -> float:
    """Best-of-rounds CPU microseconds per call of run()."""
    best = float("inf")
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(n):
            run()
        best = min(best, time.process_time() - started)
    return best / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", default="proxy.protocol.rewriter", help="module providing the rewriter API")
    ap.add_argument("--n", type=int, default=3000, help="responses per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    mod = importlib.import_module(args.impl)
    body = (FIXTURES / "final_chat.body").read_bytes()
    stream = (FIXTURES / "final_chat_stream.body").read_bytes()

    def ctx():
        return mod.ResponseContext(response_id="resp_bench", model="tiny-model", created_at=0, echo={}, tools={})

    def direct() -> None:
        mod.response_from_completion(ctx(), orjson.loads(body))

    def streamed() -> None:
        rewriter = mod.StreamRewriter(ctx())
        rewriter.start()
        rewriter.feed(stream)
        rewriter.finish()

    d = _best(direct, args.n, args.rounds)
    s = _best(streamed, args.n, args.rounds)
    events = stream.count(b"data:")
    print(f"rewriter: {args.impl}  (best of {args.rounds} rounds of {args.n})")
    print(f"from the non-stream body:        {d:8.1f} us CPU per response")
    print(f"assembled from its stream ({events} events): {s:8.1f} us CPU per response ({s / d:.1f}x)")


if __name__ == "__main__":
    main()
