"""Why non-stream requests use the upstream's non-stream call: measured, not assumed.

    .venv/bin/python -m bench.nonstream_path

Builds the same Response two ways from the captured vLLM answer (final_chat): from the
non-stream chat.completion body, and by running its stream through the StreamRewriter.
"""

from __future__ import annotations

import time
from pathlib import Path

import orjson

from proxy.rewriter import ResponseContext, StreamRewriter, response_from_completion

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "vllm-0.32-cpu"


def _ctx() -> ResponseContext:
    return ResponseContext(response_id="resp_bench", model="tiny-model", created_at=0, echo={}, tools={})


def main(rounds: int = 3000) -> None:
    body = (FIXTURES / "final_chat.body").read_bytes()
    stream = (FIXTURES / "final_chat_stream.body").read_bytes()
    started = time.process_time()
    for _ in range(rounds):
        response_from_completion(_ctx(), orjson.loads(body))
    direct = (time.process_time() - started) / rounds * 1e6
    started = time.process_time()
    for _ in range(rounds):
        rewriter = StreamRewriter(_ctx())
        rewriter.start()
        rewriter.feed(stream)
        rewriter.finish()
    streamed = (time.process_time() - started) / rounds * 1e6
    events = stream.count(b"data:")
    print(f"from the non-stream body:        {direct:8.1f} us CPU per response")
    print(f"assembled from its stream ({events} events): {streamed:8.1f} us CPU per response "
          f"({streamed / direct:.1f}x)")


if __name__ == "__main__":
    main()
