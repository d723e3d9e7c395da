"""The README's first command: serve DDTree with vLLM's OpenAI server, send one request, report, stop cleanly.

Until the embedded trained checkpoints land, the demo serves the tiny random-weight Qwen3 target + DFlash drafter
from ``vllm_ddtree.tiny_models`` (so the text is gibberish and the acceptance length is about 1): it proves the
install, the plugin, the ``"method": "ddtree"`` config and the serving path end to end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from vllm_ddtree import tiny_models

MODELS = Path(os.environ.get("DDTREE_DEMO_MODELS", Path.home() / ".cache/vllm-ddtree/demo-models"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the vLLM server exited with code {proc.returncode}; see the log above")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise SystemExit(f"the vLLM server did not become healthy within {timeout_s:.0f} s")


def spec_metric(metrics: str, name: str) -> float:
    found = re.findall(rf"^vllm:{name}_total(?:{{[^}}]*}})? ([0-9.eE+-]+)$", metrics, flags=re.M)
    return sum(float(v) for v in found)


def main() -> None:
    if not (MODELS / "target" / "tokenizer.json").exists():
        tiny_models.write_tiny_pair(MODELS)
    target, drafter = MODELS / "target", MODELS / "drafter"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    spec = {"method": "ddtree", "model": str(drafter), "num_speculative_tokens": 15, "topk": 4,
            "draft_load_config": {"load_format": "safetensors"}}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
           "--served-model-name", "ddtree-demo", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
           "--speculative-config", json.dumps(spec)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        wait_healthy(url, proc)
        from openai import OpenAI

        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        start = time.perf_counter()
        out = client.completions.create(model="ddtree-demo", prompt="def shuffle(self, x):", max_tokens=64,
                                        temperature=0.0)
        elapsed = time.perf_counter() - start
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        drafts = spec_metric(metrics, "spec_decode_num_drafts")
        accepted = spec_metric(metrics, "spec_decode_num_accepted_tokens")
        tokens = out.usage.completion_tokens
        print("\n--- completion ---")
        print(out.choices[0].text)
        print("------------------")
        print(f"completion tokens: {tokens}, {tokens / elapsed:.1f} tok/s (one request, CPU)")
        if drafts:
            print(f"mean acceptance length: {1 + accepted / drafts:.2f} ({int(drafts)} verify steps)")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        print("server stopped")


if __name__ == "__main__":
    main()
