"""DDTree behind vLLM's OpenAI server under concurrent mixed load with client aborts, then with a KV cache small
enough to force preemption: the server must answer every request without a 5xx, keep its engine alive, and give the
same greedy tokens after the load as before it (issue 39, deliverable 3).

For each pair (``mla``: stdlib-mla-tiny + its DFlash drafter, GPU only, vLLM-CPU has no MLA; ``gqa``:
stdlib-qwen3-tiny + its drafter) the script starts vLLM's OpenAI server itself (``vllm_ddtree.launch``) with
``--speculative-config '{"method": "ddtree", "model": <drafter>, "num_speculative_tokens": 15}'`` and vLLM's default
serving config otherwise (bf16 on a GPU with vLLM's default torch.compile and CUDA graphs on Model Runner V2;
float32 on vLLM-CPU), and runs three phases:

1. reference: greedy token ids (``return_token_ids``) of the first ``--ref-prompts`` held-out prompts
   (``models/heldout_prompts.json``), ``--ref-tokens`` tokens each, one request at a time, each with its own
   ``cache_salt`` so no phase reuses another's prefix-cache blocks: the reference and the after-phase compute
   every token the same way, and only a fault (stale state left by an aborted or preempted request) can change them.
   The set runs twice, so ``reference_reproducible`` says whether the idle server itself is deterministic;
2. load + faults: ``--streams`` concurrent clients (started within ``--ramp`` s) with mixed parameters (greedy,
   temperature / top-p / top-k, seeded, logprobs, penalties, n=2, stop strings, min_tokens + top-k; streaming and
   not); ``--abort-fraction`` of them abort mid-request (a stream closes after 1-6 chunks, a plain request is
   cancelled after a random delay up to ``--abort-max-delay`` s). Recorded per request: HTTP status, in-stream
   error events, unexpected connection drops, time to first token (streams), end-to-end latency, output tokens;
   per run: throughput (output tokens received / load wall time) and p50 / p99 latency and TTFT. The run then waits
   until the server has no running or waiting request left (an aborted request that is never freed fails it);
3. after: the reference prompts again, which must equal the reference token for token.

The ``preempt`` run repeats all of it on a second server whose KV cache (``--num-gpu-blocks-override``, which
vLLM 0.26 honours on GPUs and on vLLM-CPU; the block size is read from the first run's log) holds 1.1
``max_model_len`` requests plus two blocks, or an eighth of the load's output tokens if that is more, so the load
must preempt; the count comes from the server's ``vllm:num_preemptions_total``. When the load cannot overflow such
a cache (few streams or tokens, as in a CPU smoke run), that server also gets a smaller ``--max-model-len`` and, on
vLLM-CPU, 32-token blocks (printed; with the GPU defaults it keeps vLLM's max_model_len and block size, so the
second server reuses the first one's torch.compile cache). Between phases: ``/health`` must be 200 and the API
server and its engine-core (vLLM-CPU: and worker) processes alive (engine deaths = 0). ``--kill-engine`` is a
self-test of that accounting: it SIGKILLs the engine core during the load, and the run must fail.

Exit status 1 if any run had a 5xx (HTTP or in-stream), an in-stream error, an unexpected drop, a request timeout,
an engine death, a server that did not drain or failed to start, a greedy change, or a preempt run without
preemptions. The JSON (``--out``) is rewritten after every run, so a run cut short keeps the finished ones.

    VLLM_USE_FLASHINFER_SAMPLER=0 python bench/load_faults.py --deadline 540   # H200: both pairs and runs
    python bench/load_faults.py --pairs gqa --streams 24 --max-tokens 32        # vLLM-CPU smoke run (~6 min)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from meta import run_meta  # noqa: E402

from vllm_ddtree.launch import mean_acceptance_length, openai_server_process, spec_decode_counters  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
PAIRS = {"mla": ("stdlib-mla-tiny", "stdlib-mla-tiny-dflash"), "gqa": ("stdlib-qwen3-tiny", "stdlib-qwen3-tiny-dflash")}
PROMPTS = MODELS / "heldout_prompts.json"
SERVED = "ddtree"
BUDGET = 15
# No min_p or logit_bias: vLLM 0.26 refuses both with any speculative decoding (SamplingParams._validate_spec_decode).
KINDS = ["greedy", "sampled", "seeded", "logprobs", "penalties", "n2", "stop", "min_tokens"]
# A cache of one max_model_len request plus this margin: vLLM refuses to start below one request.
PREEMPT_MARGIN = 1.1
# The load should want this many times the preempt cache: output tokens x streams / this >= the cache.
PREEMPT_PRESSURE = 8
# The config of every earlier GPU measurement (no torch.compile, FULL decode graphs): --fallback's retry.
FALLBACK_CC = ["--compilation-config", json.dumps({"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"})]


# ---------------------------------------------------------------------------------------------------------------
# Server probes


def http_status(url: str, timeout: float = 10.0) -> int:
    """GET ``url``'s status; 0 when nothing answers (a dead server is a result here, not an exception)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def read_metrics(url: str) -> list[tuple[str, dict[str, str], float]]:
    """``/metrics`` as (name, labels, value) rows; empty when the server does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{.*\})? ([0-9.eE+-]+|NaN|[+-]Inf)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            rows.append((m.group(1), labels, float(m.group(3))))
    return rows


def metric_sum(rows: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """Sum of ``name`` over every label set that has ``labels``."""
    return sum(v for n, lab, v in rows if n == name and all(lab.get(k) == w for k, w in labels.items()))


def cache_info(url: str) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` (block size, number of blocks, ...)."""
    for name, labels, _ in read_metrics(url):
        if name == "vllm:cache_config_info":
            return labels
    return {}


def served_max_model_len(url: str) -> int | None:
    """``max_model_len`` from ``/v1/models``: the default depends on the model, and the preempt cache on it."""
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
            return int(json.loads(r.read())["data"][0]["max_model_len"])
    except (OSError, KeyError, IndexError, TypeError, ValueError):
        return None


def log_kv_tokens(log_path: Path) -> int | None:
    """vLLM's 'KV cache size: N tokens' line: the cache's real token capacity, whatever block size the attention
    backend picked (the MLA backends use larger blocks than the default)."""
    try:
        found = re.findall(r"KV cache size: ([\d,]+) tokens", log_path.read_text(errors="replace"))
    except OSError:
        return None
    return int(found[-1].replace(",", "")) if found else None


def log_tail(log_path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no server log)"


class EngineWatch:
    """The API server process and its engine-core (and, on vLLM-CPU, worker) children: a process that was alive
    when the server became healthy and is gone at a check is an engine death (vLLM does not restart engines)."""

    def __init__(self, proc: Any) -> None:
        import psutil

        self.proc = proc
        self.psutil = psutil
        self.pids = [proc.pid]
        self.children: list[Any] = []
        try:
            self.children = psutil.Process(proc.pid).children(recursive=True)
            for child in self.children:
                try:
                    title = " ".join(child.cmdline()) + " " + child.name()
                    if "EngineCore" in title or "VLLM::Worker" in title:
                        self.pids.append(child.pid)
                except psutil.Error:
                    continue
        except psutil.Error:
            pass
        self.engine_processes = len(self.pids) - 1
        self.dead: set[int] = set()

    def reap(self) -> None:
        """Kill the server's children that outlived it (after an engine death the API server may exit first);
        ``is_running`` compares start times, so a recycled pid is left alone."""
        for child in self.children:
            try:
                if child.is_running():
                    child.kill()
            except self.psutil.Error:
                continue

    def check(self) -> list[int]:
        """Pids dead so far (cumulative)."""
        for pid in self.pids:
            try:
                p = self.psutil.Process(pid)
                alive = p.is_running() and p.status() != self.psutil.STATUS_ZOMBIE
            except self.psutil.Error:
                alive = False
            if pid == self.proc.pid and self.proc.poll() is not None:
                alive = False
            if not alive:
                self.dead.add(pid)
        return sorted(self.dead)


def phase_check(url: str, watch: EngineWatch, phase: str) -> dict[str, Any]:
    """/health and the processes after a phase."""
    return {"phase": phase, "health": http_status(f"{url}/health"), "dead_pids": watch.check()}


# ---------------------------------------------------------------------------------------------------------------
# Requests


@dataclass
class Outcome:
    """What one load client saw."""

    index: int
    kind: str
    stream: bool
    planned_abort: bool
    aborted: bool = False
    status: int | None = None
    stream_error_code: int | None = None
    error: str | None = None
    drop: bool = False
    timeout: bool = False
    ttft_s: float | None = None
    latency_s: float | None = None
    output_tokens: int = 0
    token_ids: list[int] | None = field(default=None, repr=False)


def plan_load(args: argparse.Namespace, prompts: list[list[int]], seed: int) -> list[dict[str, Any]]:
    """The load clients, the same for every run and pair (seeded): kind, streaming, abort plan, body, start time."""
    rng = random.Random(seed)
    plans = []
    for i in range(args.streams):
        kind = KINDS[i % len(KINDS)]
        stream = rng.random() < 0.5
        compare_to = None
        if kind == "greedy":
            compare_to = rng.randrange(args.ref_prompts)
            prompt = prompts[compare_to]
            body: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True}
        else:
            source = rng.choice(prompts)
            prompt = source[: rng.randint(min(8, len(source)), len(source))]
            body = {"ignore_eos": rng.random() < 0.5}
            body.update({
                "sampled": lambda: {"temperature": 0.8, "top_p": 0.95, "top_k": 40},
                "seeded": lambda: {"temperature": 1.0, "top_p": 0.9, "seed": rng.randrange(1 << 30)},
                "logprobs": lambda: {"temperature": rng.choice([0.0, 0.7]), "logprobs": 3},
                "penalties": lambda: {"temperature": 0.7, "presence_penalty": 0.5, "frequency_penalty": 0.3,
                                      "repetition_penalty": 1.1},
                "n2": lambda: {"temperature": 0.8, "n": 2},
                "stop": lambda: {"temperature": rng.choice([0.0, 0.7]), "stop": ["\n\n", "return "],
                                 "include_stop_str_in_output": rng.random() < 0.5},
                "min_tokens": lambda: {"temperature": 0.9, "top_k": 20, "min_tokens": 8},
            }[kind]())  # fmt: skip
        max_tokens = rng.randint(max(1, args.max_tokens // 4), args.max_tokens)
        body.update({"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "return_token_ids": True,
                     "stream": stream})  # fmt: skip
        if stream:
            body["stream_options"] = {"include_usage": True}
        abort = None
        if rng.random() < args.abort_fraction:
            abort = (
                {"after_chunks": rng.randint(1, 6)} if stream else {"after_s": rng.uniform(0.02, args.abort_max_delay)}
            )
        plans.append({"index": i, "kind": kind, "stream": stream, "abort": abort, "body": body,
                      "start_s": rng.uniform(0.0, args.ramp), "compare_to": compare_to})  # fmt: skip
    return plans


_DROPS = (ConnectionError, OSError)  # with aiohttp's ClientError added at run time


async def _stream(session: Any, url: str, plan: dict[str, Any], out: Outcome, t0: float) -> None:
    """Read a stream's SSE events; close after ``after_chunks`` chunks when the plan aborts it."""
    after = (plan["abort"] or {}).get("after_chunks")
    chunks, done, usage_tokens, tokens = 0, False, None, []
    async with session.post(f"{url}/v1/completions", json=plan["body"]) as resp:
        out.status = resp.status
        if resp.status != 200:
            out.error = (await resp.text(errors="replace"))[:300]
            out.latency_s = time.perf_counter() - t0
            return
        async for raw in resp.content:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                err = event["error"] if isinstance(event["error"], dict) else {"message": str(event["error"])}
                out.stream_error_code = int(err.get("code") or 500)
                out.error = str(err.get("message"))[:300]
                continue
            if event.get("usage"):
                usage_tokens = event["usage"].get("completion_tokens")
            got = False
            for choice in event.get("choices") or []:
                ids = choice.get("token_ids") or []
                if choice.get("index", 0) == 0:
                    tokens += ids
                out.output_tokens += len(ids)
                got = got or bool(ids) or bool(choice.get("text"))
            if got:
                chunks += 1
                if out.ttft_s is None:
                    out.ttft_s = time.perf_counter() - t0
            if after is not None and chunks >= after:
                out.aborted = True
                resp.close()  # drop the connection mid-stream: the server must abort the request
                break
    out.latency_s = time.perf_counter() - t0
    if out.aborted:
        return
    if not done:
        out.drop = True
        out.error = out.error or "stream ended without [DONE]"
    if usage_tokens is not None:
        out.output_tokens = usage_tokens
    out.token_ids = tokens


async def _plain(session: Any, url: str, plan: dict[str, Any], out: Outcome, t0: float) -> None:
    async with session.post(f"{url}/v1/completions", json=plan["body"]) as resp:
        out.status = resp.status
        payload = await resp.json(content_type=None)
    out.latency_s = time.perf_counter() - t0
    if resp.status == 200:
        out.output_tokens = int(payload.get("usage", {}).get("completion_tokens", 0))
        choices = sorted(payload.get("choices", []), key=lambda c: c.get("index", 0))
        out.token_ids = list(choices[0].get("token_ids") or []) if choices else None
    else:
        out.error = json.dumps(payload)[:300]


async def run_client(session: Any, url: str, plan: dict[str, Any], t_load: float, drops: tuple) -> Outcome:
    """One load client: wait for its start time, send, abort as planned; never raises."""
    out = Outcome(plan["index"], plan["kind"], plan["stream"], plan["abort"] is not None)
    await asyncio.sleep(max(0.0, t_load + plan["start_s"] - time.perf_counter()))
    t0 = time.perf_counter()

    async def send() -> None:
        try:
            await (_stream if plan["stream"] else _plain)(session, url, plan, out, t0)
        except asyncio.TimeoutError:
            out.timeout = True
            out.error = "client timeout"
        except drops as e:
            out.drop = True
            out.error = f"{type(e).__name__}: {e}"[:300]
        except Exception as e:  # noqa: BLE001 - a malformed answer is a result to record, not a crash of the bench
            out.drop = True
            out.error = f"{type(e).__name__}: {e}"[:300]

    after_s = (plan["abort"] or {}).get("after_s")
    if after_s is None:
        await send()
    else:
        try:
            await asyncio.wait_for(send(), timeout=after_s)
        except asyncio.TimeoutError:  # our cancel, not the client's: send() handles aiohttp's own timeouts
            out.aborted = True
            out.latency_s = time.perf_counter() - t0
    return out


async def load_phase(url: str, plans: list[dict[str, Any]], timeout_s: float) -> tuple[list[Outcome], float]:
    """All clients at once (an unlimited connection pool, so ``--streams`` really are concurrent)."""
    import aiohttp

    drops = (aiohttp.ClientError, *_DROPS)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        t_load = time.perf_counter()
        outcomes = await asyncio.gather(*(run_client(session, url, p, t_load, drops) for p in plans))
        wall = time.perf_counter() - t_load
    return list(outcomes), wall


async def greedy_set(url: str, prompts: list[list[int]], max_tokens: int, salt: str, timeout_s: float) -> dict:
    """Greedy token ids of ``prompts``, one request at a time on an idle server, each with a fresh cache salt
    (so every phase prefills every prompt from scratch: same batch, same kernels, same tokens)."""
    import aiohttp

    tokens: list[list[int] | None] = []
    statuses: list[int] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        for i, prompt in enumerate(prompts):
            body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True, "cache_salt": f"{salt}-{i}"}  # fmt: skip
            try:
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    payload = await resp.json(content_type=None)
                    statuses.append(resp.status)
                    tokens.append(list(payload["choices"][0]["token_ids"]) if resp.status == 200 else None)
            except Exception as e:  # noqa: BLE001 - a dead server gives None tokens: a greedy change, reported
                statuses.append(0)
                tokens.append(None)
                print(f"  greedy request {i} failed: {type(e).__name__}: {e}", flush=True)
                if isinstance(e, asyncio.TimeoutError):  # a stuck server: the other prompts would wait as long
                    statuses += [0] * (len(prompts) - i - 1)
                    tokens += [None] * (len(prompts) - i - 1)
                    break
    return {"tokens": tokens, "statuses": statuses}


async def wait_drained(url: str, limit_s: float) -> tuple[bool, float, float | None]:
    """Wait until the server has no running or waiting request: aborted requests must be freed, not leaked."""
    t0 = time.perf_counter()
    left = None
    while time.perf_counter() - t0 < limit_s:
        rows = await asyncio.to_thread(read_metrics, url)
        if not rows and await asyncio.to_thread(http_status, f"{url}/health") == 0:
            break  # nothing answers: the server is gone (an engine death, reported as such)
        if rows:
            left = metric_sum(rows, "vllm:num_requests_running") + metric_sum(rows, "vllm:num_requests_waiting")
            if left == 0:
                return True, time.perf_counter() - t0, 0.0
        await asyncio.sleep(0.5)
    return False, time.perf_counter() - t0, left


# ---------------------------------------------------------------------------------------------------------------
# One server run


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def server_args(pair: str, gpu: bool, extra: list[str]) -> list[str]:
    """vLLM's defaults except the dtype (bf16 on a GPU, which the models are; float32 on vLLM-CPU)."""
    target, drafter = (MODELS / name for name in PAIRS[pair])
    spec = {"method": "ddtree", "model": str(drafter), "num_speculative_tokens": BUDGET}
    return ["--model", str(target), "--served-model-name", SERVED, "--dtype", "bfloat16" if gpu else "float32",
            "--speculative-config", json.dumps(spec), *extra]  # fmt: skip


def summarize_load(outcomes: list[Outcome], wall: float, reference: list[list[int] | None],
                   plans: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """Per-run numbers of the load phase."""
    statuses = Counter(
        str(o.status) if o.status is not None else ("aborted" if o.aborted else "none") for o in outcomes
    )
    completed = [o for o in outcomes if not o.aborted and o.status == 200 and not o.drop and not o.timeout]
    latencies = [o.latency_s for o in completed if o.latency_s is not None]
    ttfts = [o.ttft_s for o in outcomes if o.stream and o.ttft_s is not None and o.status == 200]
    tokens = sum(o.output_tokens for o in outcomes)
    equal = compared = 0
    done = {o.index for o in completed}
    for o, p in zip(outcomes, plans, strict=True):  # informational: bf16 batches may flip near-ties
        ref = reference[p["compare_to"]] if p["compare_to"] is not None and reference else None
        if ref is not None and o.index in done and o.token_ids is not None:
            n = min(len(ref), len(o.token_ids))
            compared += 1
            equal += o.token_ids[:n] == ref[:n]
    errors = Counter(_scrub(o.error) for o in outcomes if o.error)
    return {
        "requests": len(outcomes),
        "abort_planned": sum(o.planned_abort for o in outcomes),
        "aborted": sum(o.aborted for o in outcomes),
        "completed": len(completed),
        "streaming": sum(o.stream for o in outcomes),
        "kinds": dict(Counter(o.kind for o in outcomes)),
        "status_counts": dict(sorted(statuses.items())),
        "http_5xx": sum(o.status is not None and o.status >= 500 for o in outcomes),
        "stream_errors": sum(o.stream_error_code is not None for o in outcomes),
        "stream_5xx": sum(o.stream_error_code is not None and o.stream_error_code >= 500 for o in outcomes),
        "unexpected_drops": sum(o.drop for o in outcomes),
        "timeouts": sum(o.timeout for o in outcomes),
        "output_tokens": tokens,
        "load_wall_s": round(wall, 3),
        "throughput_tok_s": round(tokens / wall, 1) if wall > 0 else None,
        "latency_p50_s": _r(percentile(latencies, 50)),
        "latency_p99_s": _r(percentile(latencies, 99)),
        "ttft_p50_s": _r(percentile(ttfts, 50)),
        "ttft_p99_s": _r(percentile(ttfts, 99)),
        "greedy_under_load": {"compared": compared, "equal": equal},
        "errors": dict(errors.most_common(10)),
        "anomalies": [_anomaly(o, p) for o, p in zip(outcomes, plans, strict=True) if _is_anomaly(o)][:50],
    }


def _is_anomaly(o: Outcome) -> bool:
    return o.drop or o.timeout or o.stream_error_code is not None or (o.status is not None and o.status != 200)


def _anomaly(o: Outcome, plan: dict[str, Any]) -> dict[str, Any]:
    """A request that went wrong, with what it asked for (the prompt as its length)."""
    body = {k: v for k, v in plan["body"].items() if k not in ("prompt", "model", "return_token_ids")}
    row = {k: v for k, v in vars(o).items() if k != "token_ids"}
    row["error"] = _scrub(row["error"]) if row["error"] else None
    return {**row, "prompt_len": len(plan["body"]["prompt"]), "body": body, "abort": plan["abort"]}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def run_server(pair: str, mode: str, args: argparse.Namespace, gpu: bool, extra: list[str], log_path: Path,
               startup_timeout: float) -> dict[str, Any]:  # fmt: skip
    """One server: reference, load + faults, after; the run's record (``error`` set if it could not run)."""
    prompts = json.loads(PROMPTS.read_text())
    ref_prompts = prompts[: args.ref_prompts]
    plans = plan_load(args, prompts, seed=args.seed)
    cmd = server_args(pair, gpu, extra)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if gpu:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # the plugin sets it too; explicit, as the other benches do
    rec: dict[str, Any] = {"pair": pair, "run": mode, "server_args": [_rel(a) for a in cmd], "log": log_path.name}
    t_start = time.perf_counter()
    watch: EngineWatch | None = None
    print(f"[{pair}/{mode}] starting the server: {' '.join(rec['server_args'])}", flush=True)
    try:
        with openai_server_process(cmd, env=env, timeout_s=startup_timeout, log_path=str(log_path)) as (url, proc):
            rec["startup_s"] = round(time.perf_counter() - t_start, 1)
            watch = EngineWatch(proc)
            info = cache_info(url)
            rec["max_model_len"] = served_max_model_len(url)
            blocks = _int(info.get("num_gpu_blocks"))
            rec["kv_cache"] = {"block_size": _int(info.get("block_size")), "num_blocks": blocks,
                               "tokens": log_kv_tokens(log_path)}  # fmt: skip
            rec["engine_processes"] = watch.engine_processes
            print(f"[{pair}/{mode}] up in {rec['startup_s']} s; max_model_len {rec['max_model_len']}, KV cache "
                  f"{rec['kv_cache']}", flush=True)  # fmt: skip
            checks = [phase_check(url, watch, "start")]
            ref = asyncio.run(greedy_set(url, ref_prompts, args.ref_tokens, f"{mode}-ref", args.timeout))
            # The same again on the idle server: a greedy change after the load only counts if this one is equal.
            again = asyncio.run(greedy_set(url, ref_prompts, args.ref_tokens, f"{mode}-ref2", args.timeout))
            checks.append(phase_check(url, watch, "reference"))
            before = read_metrics(url)
            print(f"[{pair}/{mode}] load: {len(plans)} clients", flush=True)
            if args.kill_engine and len(watch.pids) > 1:  # self-test of the fault accounting
                threading.Timer(args.ramp, os.kill, (watch.pids[1], signal.SIGKILL)).start()
            outcomes, wall = asyncio.run(load_phase(url, plans, args.timeout))
            drained, drain_s, left = asyncio.run(wait_drained(url, min(60.0, args.timeout)))
            after_load = read_metrics(url)
            checks.append(phase_check(url, watch, "load"))
            after = asyncio.run(greedy_set(url, ref_prompts, args.ref_tokens, f"{mode}-after", args.timeout))
            checks.append(phase_check(url, watch, "after"))
            end = read_metrics(url)
            counters = spec_decode_counters(url) if http_status(f"{url}/health") == 200 else {}
    except Exception as e:  # noqa: BLE001 - a server that cannot start is this run's result; the others still run
        traceback.print_exc()
        rec["error"] = _scrub(f"{type(e).__name__}: {e}")
        rec["startup_failed"] = "startup_s" not in rec
        rec["log_tail"] = _scrub(log_tail(log_path, 30))
        rec["wall_s"] = round(time.perf_counter() - t_start, 1)
        print(f"[{pair}/{mode}] FAILED: {rec['error']}\n--- server log tail ---\n{log_tail(log_path)}", flush=True)
        return rec
    finally:
        if watch is not None:
            watch.reap()
    rec.update(summarize_load(outcomes, wall, ref["tokens"], plans))
    mismatch = [i for i, (a, b) in enumerate(zip(ref["tokens"], after["tokens"], strict=True)) if a is None or a != b]
    rec.update({
        "drained": drained, "drain_s": round(drain_s, 2), "requests_left": left,
        "preemptions_load": metric_sum(after_load, "vllm:num_preemptions_total")
        - metric_sum(before, "vllm:num_preemptions_total"),
        "preemptions": metric_sum(end, "vllm:num_preemptions_total"),
        "corrupted_requests": metric_sum(end, "vllm:corrupted_requests_total"),
        "checks": checks,
        "health_ok": all(c["health"] == 200 for c in checks),
        "engine_deaths": len(checks[-1]["dead_pids"]),
        "greedy_statuses": {"reference": ref["statuses"], "after": after["statuses"]},
        "reference_reproducible": ref["tokens"] == again["tokens"] and None not in ref["tokens"],
        "greedy_unchanged": not mismatch,
        "greedy_mismatch_prompts": mismatch,
        "reference_tokens": ref["tokens"],
        "mean_acceptance_length": _r(mean_acceptance_length(counters)) if counters else None,
        "wall_s": round(time.perf_counter() - t_start, 1),
    })  # fmt: skip
    return rec


def _int(x: str | None) -> int | None:
    try:
        return int(x) if x not in (None, "None") else None
    except ValueError:
        return None


def _scrub(text: str) -> str:
    """Text for the JSON without this machine's paths (bench JSON names no machine: ``bench/meta.py``)."""
    return text.replace(str(ROOT), "<repo>").replace(str(Path.home()), "~").replace(tempfile.gettempdir(), "<tmp>")


def _rel(arg: str) -> str:
    """Server arguments without this machine's absolute paths."""
    return arg.replace(str(ROOT) + os.sep, "")


def failures(rec: dict[str, Any]) -> list[str]:
    """Why a run fails (empty: it passed)."""
    label = f"{rec['pair']}/{rec['run']}"
    if "error" in rec:
        return [f"{label}: {rec['error']}"]
    out = []
    for key, what in (
        ("http_5xx", "HTTP 5xx"),
        ("stream_errors", "in-stream errors"),
        ("unexpected_drops", "unexpected drops"),
        ("timeouts", "request timeouts"),
        ("engine_deaths", "engine deaths"),
    ):
        if rec.get(key):
            out.append(f"{label}: {rec[key]} {what}")
    if not rec["health_ok"]:
        out.append(f"{label}: /health != 200 at {[c['phase'] for c in rec['checks'] if c['health'] != 200]}")
    if not rec["drained"]:
        left = "?" if rec["requests_left"] is None else int(rec["requests_left"])
        out.append(f"{label}: {left} requests still running/waiting {rec['drain_s']} s after the load")
    if not rec["greedy_unchanged"]:
        why = (
            "" if rec["reference_reproducible"] else " (but the reference itself did not reproduce on the idle server)"
        )
        out.append(f"{label}: greedy outputs changed for prompts {rec['greedy_mismatch_prompts']}{why}")
    if rec["run"] == "preempt" and not rec["preemptions"]:
        out.append(f"{label}: no preemption happened (the check did not run)")
    return out


def preempt_extra(args: argparse.Namespace, first: dict[str, Any] | None, gpu: bool) -> tuple[list[str], dict]:
    """Server flags for the preempt run: a KV cache of ~1.1 max_model_len requests plus two blocks (the override
    counts vLLM's null block, and one request that cannot fit alone is preempted forever instead of failing), from
    the first run's block size (its log's token capacity / its block count) and max_model_len. When the load could
    not overflow that, a smaller max_model_len, and on vLLM-CPU 32-token blocks instead of 128 (a request only
    preempts when it needs another block, and a short CPU request never leaves its first one)."""
    kv = (first or {}).get("kv_cache") or {}
    block = kv.get("block_size") or (16 if gpu else 128)
    if kv.get("tokens") and kv.get("num_blocks"):
        block = max(1, round(kv["tokens"] / kv["num_blocks"]))
    mml = (first or {}).get("max_model_len") or 2048
    extra: list[str] = []
    note = ""
    pressure = args.streams * args.max_tokens // PREEMPT_PRESSURE
    if args.preempt_max_model_len or pressure < PREEMPT_MARGIN * mml:
        new = args.preempt_max_model_len or 64 * math.ceil(
            (max(len(p) for p in _prompts()) + args.max_tokens + 64) / 64
        )
        new = max(new, args.ref_tokens + 64)
        note = (
            (
                f"max_model_len {mml} -> {new}: {args.streams} streams x {args.max_tokens} tokens cannot overflow "
                f"a cache that must hold one {mml}-token request"
            )
            if not args.preempt_max_model_len
            else ""
        )
        mml = new
        extra += ["--max-model-len", str(mml)]
        if not gpu:
            block = 32
            extra += ["--block-size", str(block)]
    blocks = args.preempt_blocks or max(math.ceil(PREEMPT_MARGIN * mml / block) + 2, math.ceil(pressure / block))
    extra += ["--num-gpu-blocks-override", str(blocks)]
    return extra, {"block_size": block, "blocks": blocks, "tokens": blocks * block, "max_model_len": mml,
                   "note": note}  # fmt: skip


def _prompts() -> list[list[int]]:
    return json.loads(PROMPTS.read_text())


# ---------------------------------------------------------------------------------------------------------------
# Main


COLUMNS = ["pair/run", "reqs", "aborted", "5xx", "drops", "deaths", "preempt", "tok/s", "lat p50", "lat p99",
           "ttft p50", "ttft p99", "greedy"]  # fmt: skip


def table_row(r: dict[str, Any]) -> str:
    """One run as a row of the stdout table."""
    if "error" in r:
        return f"{r['pair'] + '/' + r['run']:>12} | failed: {r['error']}"
    cells = [f"{r['pair']}/{r['run']}", r["requests"], r["aborted"], r["http_5xx"] + r["stream_5xx"],
             r["unexpected_drops"], r["engine_deaths"], int(r["preemptions"]), r["throughput_tok_s"],
             r["latency_p50_s"], r["latency_p99_s"], r["ttft_p50_s"], r["ttft_p99_s"],
             "same" if r["greedy_unchanged"] else f"DIFF {r['greedy_mismatch_prompts']}"]  # fmt: skip
    return " | ".join(f"{'-' if c is None else c!s:>{12 if i == 0 else 8}}" for i, c in enumerate(cells))


def print_table(records: list[dict[str, Any]]) -> None:
    print(" | ".join(f"{c:>{12 if i == 0 else 8}}" for i, c in enumerate(COLUMNS)))
    for r in records:
        print(table_row(r))


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200', the suffix the other benches' H200 results carry."""
    words = re.sub(r"[^a-z0-9 ]+", "", name.lower()).split()
    return words[-1] if words and name not in ("none", "unknown") else "gpu"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default="mla,gqa", help="comma-separated, from: mla, gqa (mla needs a GPU)")
    parser.add_argument("--streams", type=int, default=200, help="concurrent load clients per run")
    parser.add_argument("--abort-fraction", type=float, default=0.3)
    parser.add_argument("--max-tokens", type=int, default=128, help="load requests ask for max_tokens/4..this")
    parser.add_argument(
        "--preempt",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run each pair on a server with a KV cache that forces preemption",
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="per-request client timeout, seconds")
    parser.add_argument("--ref-prompts", type=int, default=8)
    parser.add_argument("--ref-tokens", type=int, default=64)
    parser.add_argument("--ramp", type=float, default=1.0, help="load clients start within this many seconds")
    parser.add_argument("--abort-max-delay", type=float, default=2.0, help="plain requests abort within this (s)")
    parser.add_argument("--preempt-blocks", type=int, default=None, help="KV blocks of the preempt run (default: "
                        "~1.1 max_model_len requests)")  # fmt: skip
    parser.add_argument("--preempt-max-model-len", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0, help="seed of the load plan")
    parser.add_argument("--deadline", type=float, default=None, help="skip runs that would not finish within this "
                        "many seconds of the start (estimated from the runs so far)")  # fmt: skip
    parser.add_argument("--startup-timeout", type=float, default=420.0, help="seconds a server may take to start")
    parser.add_argument(
        "--fallback",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a GPU, if a server does not start with vLLM's default compile/graph config, retry "
        "that pair with " + " ".join(FALLBACK_CC) + " (the default's failure still fails the run)",
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/load_faults_<gpu>.json")
    parser.add_argument("--kill-engine", action="store_true", help="self-test: SIGKILL the engine core once the load "
                        "has started (the run must then fail with engine deaths)")  # fmt: skip
    args = parser.parse_args()
    t0 = time.perf_counter()

    import torch

    gpu = torch.cuda.is_available()
    if gpu:  # as every GPU run of this repository (scripts/device): no FlashInfer sampler JIT on an offline machine
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    meta = run_meta()
    out_path = args.out or ROOT / "bench" / "results" / f"load_faults_{gpu_slug(meta['gpu']) if gpu else 'cpu'}.json"
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="load_faults_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    pairs = [p.strip() for p in args.pairs.split(",") if p.strip()]
    for p in pairs:
        if p not in PAIRS:
            parser.error(f"unknown pair {p!r}; choose from {', '.join(PAIRS)}")
    doc: dict[str, Any] = {"meta": meta, "config": {
        "device": meta["gpu"] if gpu else "cpu", "dtype": "bfloat16" if gpu else "float32", "budget": BUDGET,
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("out", "log_dir")},
        "env": {k: _scrub(v) for k, v in sorted(os.environ.items()) if k.startswith(("VLLM_", "DDTREE_")) and
                "KEY" not in k and "TOKEN" not in k}},
        "pairs": {}, "failures": []}  # fmt: skip
    records: list[dict[str, Any]] = []

    def save() -> None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(doc, indent=1) + "\n")

    walls: dict[str, float] = {}  # per mode, the latest run's wall time: the estimate for the next of that mode
    for pair in pairs:
        entry: dict[str, Any] = doc["pairs"].setdefault(pair, {"runs": {}})
        if pair == "mla" and not gpu:
            entry["skipped"] = "vLLM-CPU has no MLA attention: the MLA pair runs on GPUs only"
            print(f"[mla] skipped: {entry['skipped']}", flush=True)
            continue
        first: dict[str, Any] | None = None
        pair_extra: list[str] = []  # FALLBACK_CC once the default config failed to start for this pair
        for mode in ["default", "preempt"] if args.preempt else ["default"]:
            elapsed = time.perf_counter() - t0
            estimate = walls.get(mode, max(walls.values(), default=0.0))
            if args.deadline and elapsed + estimate > args.deadline:
                entry["runs"][mode] = {"skipped": f"deadline: {elapsed:.0f} s gone, the run takes ~{estimate:.0f} s"}
                doc["failures"].append(f"{pair}/{mode}: skipped at the deadline")
                print(f"[{pair}/{mode}] skipped: {entry['runs'][mode]['skipped']}", flush=True)
                save()
                continue
            extra, plan = [], None
            if mode == "preempt":
                extra, plan = preempt_extra(args, first, gpu)
                if plan["note"]:
                    print(f"[{pair}/preempt] {plan['note']}", flush=True)
            startup = min(args.startup_timeout, args.deadline - elapsed) if args.deadline else args.startup_timeout
            log = log_dir / f"server_{pair}_{mode}.log"
            rec = run_server(pair, mode, args, gpu, extra + pair_extra, log, max(60.0, startup))
            if rec.get("startup_failed") and gpu and args.fallback and not pair_extra:
                # vLLM's default compile + graph config never ran with this plugin before this bench: if it does
                # not start, the faults are still worth checking on the config every GPU measurement used.
                rec["compilation"] = "vLLM default"
                doc["failures"] += failures(rec)
                entry["runs"][f"{mode}-default-config"] = rec
                records.append(rec)
                save()
                pair_extra = FALLBACK_CC
                print(f"[{pair}/{mode}] retrying with {' '.join(FALLBACK_CC)}", flush=True)
                log = log_dir / f"server_{pair}_{mode}_fallback.log"
                elapsed = time.perf_counter() - t0
                startup = min(args.startup_timeout, args.deadline - elapsed) if args.deadline else args.startup_timeout
                rec = run_server(pair, mode, args, gpu, extra + pair_extra, log, max(60.0, startup))
            rec["compilation"] = "fallback: " + FALLBACK_CC[1] if pair_extra else "vLLM default"
            if plan:
                rec["preempt_cache"] = plan
            if mode == "default":
                first = rec
            walls[mode] = rec.get("wall_s", 0.0)
            print(f"[{pair}/{mode}] done in {rec.get('wall_s')} s: {table_row(rec)}", flush=True)
            records.append(rec)
            entry["runs"][mode] = {k: v for k, v in rec.items() if k != "reference_tokens"}
            doc["failures"] += failures(rec)
            save()
        runs = [r for r in records if r["pair"] == pair and "reference_tokens" in r]
        if len(runs) == 2:  # informational: the KV cache size alone should not move greedy tokens
            a, b = (r["reference_tokens"] for r in runs)
            entry["reference_same_across_runs"] = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y] == []
    doc["ok"] = not doc["failures"]
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    save()
    print()
    print_table(records)
    for pair, entry in doc["pairs"].items():
        if "skipped" in entry:
            print(f"{pair}: skipped ({entry['skipped']})")
    for f in doc["failures"]:
        print(f"FAIL {f}")
    print(f"{'PASS' if doc['ok'] else 'FAIL'} in {doc['wall_s']} s -> {out_path} (server logs: {log_dir})")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
