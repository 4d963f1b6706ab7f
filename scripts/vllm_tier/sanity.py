"""Quick sanity check of the vLLM tier without the proxy: start one vLLM server on the tiny
model, call /v1/chat/completions (plain, tool_choice=required) and /tokenize directly, print
the start-up time, stop the server.

    .venv-vllm/bin/python scripts/vllm_tier/sanity.py --model .vllm-tier/tiny-model [--port 8101]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import servers  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    port = args.port or servers.free_port()
    workdir = args.workdir or tempfile.mkdtemp(prefix="vllm-sanity-")
    proc = servers.start_vllm(args.python, os.path.abspath(args.model), port, workdir, name="sanity")
    try:
        took = servers.wait_ready(proc, timeout=240)
        print(f"vLLM ready after {took:.1f}s on {proc.url} (log {proc.log_path})")
        status, body = servers.http_get(proc.url + "/v1/models")
        print("models:", status, body[:200])
        t0 = time.monotonic()
        status, body = servers.http_post_json(proc.url + "/v1/chat/completions", {
            "model": servers.SERVED_MODEL, "max_tokens": 64, "seed": 1,
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}]})
        print(f"chat ({time.monotonic() - t0:.2f}s):", status, json.dumps(body)[:600])
        assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length"), body
        msg = body["choices"][0]["message"]
        print("  reasoning:", repr(msg.get("reasoning")), " content:", repr(msg.get("content")))
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "Get the weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}]
        status, body = servers.http_post_json(proc.url + "/v1/chat/completions", {
            "model": servers.SERVED_MODEL, "max_tokens": 200, "seed": 0, "tools": tools,
            "tool_choice": "required",
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}]})
        print("required:", status, json.dumps(body)[:600])
        assert status == 200 and body["choices"][0]["message"].get("tool_calls"), body
        status, body = servers.http_post_json(proc.url + "/tokenize", {
            "model": servers.SERVED_MODEL, "add_generation_prompt": True,
            "messages": [{"role": "user", "content": "Hello, who are you?"}]})
        print("tokenize:", status, body.get("count"), body.get("max_model_len"))
        assert status == 200 and body["count"] > 0
        print("SANITY OK")
        return 0
    finally:
        servers.stop(proc)


if __name__ == "__main__":
    sys.exit(main())
