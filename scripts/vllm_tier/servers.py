"""Start / wait for / stop real vLLM servers and the proxy (standard library only).

Used by scripts/vllm_tier/sanity.py and tests/vllm/conftest.py; runs under any Python 3.11.
Every process is started in its own session (process group) so that stopping it also ends the
engine-core child vLLM forks; only processes started here are ever signalled.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SERVE_PY = os.path.join(HERE, "serve.py")

# An org/name id, as vLLM serves Hugging Face models: every test goes through this name.
SERVED_MODEL = "tiny-org/tiny-model"
MAX_MODEL_LEN = 2048

VLLM_ARGS = [
    "--served-model-name", SERVED_MODEL,
    "--enforce-eager",
    "--dtype", "float32",
    "--max-model-len", str(MAX_MODEL_LEN),
    "--enable-auto-tool-choice",
    "--tool-call-parser", "hermes",
    "--tool-strict-level", "parameter",
    "--reasoning-parser", "qwen3",
    "--enable-prompt-tokens-details",
]


# The embedding model (scripts/vllm_tier/build_tiny_embedder.py), on a vLLM of its own: a pooling
# runner serves /v1/embeddings, not generation.
EMBED_MODEL = "tiny-org/tiny-embedder"
EMBED_MAX_MODEL_LEN = 512
EMBED_ARGS = [
    "--served-model-name", EMBED_MODEL,
    "--runner", "pooling",
    "--enforce-eager",
    "--dtype", "float32",
    "--max-model-len", str(EMBED_MAX_MODEL_LEN),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind (TIME_WAIT is fine)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def vllm_env(workdir: str) -> dict:
    """Environment for one vLLM server: CPU, offline, every cache under `workdir`."""
    cache = os.path.join(workdir, "cache")
    env = dict(os.environ)
    env.update({
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": os.path.join(cache, "hf"),
        "VLLM_CACHE_ROOT": os.path.join(cache, "vllm"),
        "VLLM_CONFIG_ROOT": os.path.join(cache, "vllm-config"),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
        "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
        "XDG_CACHE_HOME": cache,
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
        "PYTHONUNBUFFERED": "1",
    })
    for key in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(key, None)
    return env


@dataclass
class Proc:
    name: str
    url: str
    port: int
    popen: subprocess.Popen
    log_path: str
    started_at: float = field(default_factory=time.monotonic)
    ready_after: float | None = None

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


def start_vllm(python: str, model_dir: str, port: int, workdir: str, name: str = "vllm",
               extra_args: list[str] | None = None, args: list[str] | None = None) -> Proc:
    """`args`: instead of VLLM_ARGS (the chat model's), e.g. EMBED_ARGS."""
    os.makedirs(workdir, exist_ok=True)
    log_path = os.path.join(workdir, f"{name}.log")
    cmd = [python, SERVE_PY, "--model", model_dir, "--host", "127.0.0.1", "--port", str(port),
           *(VLLM_ARGS if args is None else args), *(extra_args or [])]
    log = open(log_path, "ab")
    log.write(("$ " + " ".join(cmd) + "\n").encode())
    log.flush()
    popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=vllm_env(workdir), cwd=workdir, start_new_session=True)
    log.close()
    return Proc(name=name, url=f"http://127.0.0.1:{port}", port=port, popen=popen, log_path=log_path)


def start_proxy(python: str, config_path: str, port: int, workdir: str, name: str = "proxy") -> Proc:
    os.makedirs(workdir, exist_ok=True)
    log_path = os.path.join(workdir, f"{name}.log")
    # --config is an option of the top-level parser (before the sub-command); the environment
    # variable says the same for a CLI that would read it from there instead.
    cmd = [python, "-m", "proxy", "--config", config_path, "serve", "--host", "127.0.0.1",
           "--port", str(port)]
    log = open(log_path, "ab")
    log.write(("$ " + " ".join(cmd) + "\n").encode())
    log.flush()
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["RESPONSES_PROXY_CONFIG"] = config_path
    popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=env, cwd=REPO, start_new_session=True)
    log.close()
    return Proc(name=name, url=f"http://127.0.0.1:{port}", port=port, popen=popen, log_path=log_path)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_post_json(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")}


def wait_ready(proc: Proc, path: str = "/health", timeout: float = 180.0) -> float:
    """Poll GET url+path until 200; raise with the log tail if the process dies or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode} before it was ready; "
                               f"log {proc.log_path}:\n{proc.log_tail()}")
        try:
            status, _ = http_get(proc.url + path, timeout=2.0)
            if status == 200:
                proc.ready_after = time.monotonic() - proc.started_at
                return proc.ready_after
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{proc.name} not ready after {timeout:.0f}s; log {proc.log_path}:\n{proc.log_tail()}")


def stop(proc: Proc, grace: float = 15.0, sig: int = signal.SIGTERM) -> None:
    """Signal the process group of a process started here; SIGKILL after `grace` seconds."""
    if proc.popen.poll() is not None:
        return
    try:
        os.killpg(proc.popen.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.popen.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.popen.wait(timeout=10)


def kill_hard(proc: Proc) -> None:
    """SIGKILL the whole process group at once (a worker dying mid-test)."""
    stop(proc, grace=0.0, sig=signal.SIGKILL)
