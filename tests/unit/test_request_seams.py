"""Client input vLLM 0.26 answers with a 500 (with or without speculative decoding): the seams that answer it with a
400 (a body that is JSON but not an object) or serve it (a choice with a line break, a grammar whose end
``ignore_eos`` or ``min_tokens`` would outlast, a grammar no allowed token satisfies)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

TARGET = Path(__file__).resolve().parents[2] / "models" / "stdlib-qwen3-tiny"
EOS = 0

# As the API server does it: ``api_server`` (and the SageMaker router with it) imported, then the plugin, then the
# routers built by ``build_app``; vLLM's own exception handlers answer.
SERVE = """
import json
from argparse import Namespace

import vllm.entrypoints.openai.api_server  # noqa: F401
from vllm_ddtree.patches import requests
requests.apply()

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from vllm.entrypoints.openai.chat_completion.api_router import attach_router as attach_chat
from vllm.entrypoints.openai.completion.api_router import attach_router as attach_completion
from vllm.entrypoints.serve.sagemaker.api_router import attach_router as attach_sagemaker
try:  # vLLM 0.32 registers the API server's exception handlers in one function
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
except ImportError:  # 0.26
    from vllm.entrypoints.serve.utils.server_utils import exception_handler, validation_exception_handler

    def init_exception_handler(app):
        app.exception_handler(RequestValidationError)(validation_exception_handler)
        app.exception_handler(Exception)(exception_handler)

app = FastAPI()
app.state.args = Namespace(log_error_stack=False)
app.state.openai_serving_completion = None  # a valid body reaches the handler: 501, no completions here
app.state.openai_serving_chat = None
attach_completion(app)
attach_chat(app)
attach_sagemaker(app, ("generate",), None)
init_exception_handler(app)
client = TestClient(app, raise_server_exceptions=False)
out = []
for path, body, kind in json.loads(input()):
    r = client.post(path, content=body, headers={"content-type": kind})
    out.append([r.status_code, r.json()["error"]["message"]])
print(json.dumps(out))
"""


def test_bodies_that_are_json_but_not_objects_are_a_400() -> None:
    """A JSON array, number, string, boolean or null body is a 400 naming what the body must be, on completions,
    chat and SageMaker's invocations alike; an object still reaches the handler, and malformed JSON, an empty body or
    another content type keep vLLM's own 400s."""
    json_kind = "application/json"
    cases = [
        ("/v1/completions", '[{"model": "m", "prompt": "x"}]', json_kind),
        ("/v1/completions", "5", json_kind),
        ("/v1/completions", '"x"', json_kind),
        ("/v1/completions", "null", json_kind),
        ("/v1/chat/completions", "[]", json_kind),
        ("/v1/chat/completions", "true", json_kind),
        ("/invocations", '[{"prompt": "x"}]', json_kind),
        ("/v1/completions", '{"model": "m", "prompt": "x"}', json_kind),
        ("/v1/completions", '{"model": "m", "prompt": ', json_kind),
        ("/v1/completions", "", json_kind),
        ("/v1/completions", '{"model": "m", "prompt": "x"}', "text/plain"),
    ]
    out = subprocess.run(
        [sys.executable, "-c", SERVE], input=json.dumps(cases), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-4000:]
    answers = json.loads(out.stdout.strip().splitlines()[-1])
    refused = [(status, message.rsplit("not ", 1)[-1]) for status, message in answers[:7]]
    assert refused == [(400, "an array"), (400, "a number"), (400, "a string"), (400, "null"), (400, "an array"),
                       (400, "a boolean"), (400, "an array")]  # fmt: skip
    assert all("The request body must be a JSON object" in message for _, message in answers[:7])
    (served, _), (malformed, decode), (empty, missing), (plain, media) = answers[7:]
    assert served == 501, answers[7]
    assert (malformed, empty, plain) == (400, 400, 400)
    assert "JSON decode error" in decode and "Field required" in missing and "Unsupported Media Type" in media


def test_a_choice_with_line_breaks_stays_on_xgrammar() -> None:
    """vLLM's choice grammar with the line breaks escaped: xgrammar compiles it (so "auto" keeps the request on the
    engine's xgrammar backend) and accepts exactly the choices, quotes and backslashes included."""
    import xgrammar as xgr
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.structured_output import backend_xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    from vllm_ddtree.patches import structured_outputs

    structured_outputs.apply()
    choices = ["a\nb", "c\r\nd", 'say "hi"\n', "back\\n", "é 🙂"]
    grammar = xgr.Grammar.from_ebnf(backend_xgrammar.choice_as_grammar(choices))
    for text in choices:
        assert _is_grammar_accept_string(grammar, text), text
    for text in ["ab", "a\\nb", "back\n", "c\nd"]:
        assert not _is_grammar_accept_string(grammar, text), text
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a\nb", "c"]))
    backend_xgrammar.validate_xgrammar_grammar(params)  # vLLM's check, which raised and sent "auto" to guidance
    assert params.structured_outputs.choice is None and params.structured_outputs.grammar


@pytest.fixture(scope="module")
def compiler() -> Any:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(TARGET))
    assert tokenizer.convert_tokens_to_ids(tokenizer.eos_token) == EOS
    return SimpleNamespace(
        tokenizer=tokenizer, xgr=xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=4096))
    )


def _ids(compiler: Any, text: str) -> list[int]:
    return compiler.tokenizer.encode(text, add_special_tokens=False)


def _request(compiler: Any, regex: str, reasoning: bool = False, **params: Any) -> Any:
    """A real engine-core request with a compiled xgrammar grammar, as the scheduler holds it mid-generation."""
    import xgrammar as xgr
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    sampling = SamplingParams(structured_outputs=StructuredOutputsParams(regex=regex), **params)
    sampling.update_from_generation_config({}, EOS)
    request = Request("req", [5, 6, 7], sampling, None)
    request.status = RequestStatus.RUNNING
    ctx = compiler.xgr.compile_regex(regex)
    grammar = XgrammarGrammar(matcher=xgr.GrammarMatcher(ctx), vocab_size=4096, ctx=ctx)
    request.structured_output_request.grammar = grammar
    request.structured_output_request.reasoning_ended = None if reasoning else True
    return request


def _scheduler(reasoning: bool = False) -> Any:
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_ddtree.patches import structured_outputs

    structured_outputs.apply()
    scheduler = object.__new__(Scheduler)
    scheduler.max_model_len = 512
    scheduler.structured_output_manager = SimpleNamespace(
        reasoner_cls=object if reasoning else None, enable_in_reasoning=False
    )
    return scheduler


def _step(scheduler: Any, request: Any, tokens: list[int]) -> tuple[list[int], bool]:
    """The scheduler's update for one step: append and check stop, then advance the grammar as vLLM does (where a
    rejection ended the request with FINISHED_ERROR)."""
    kept, stopped = scheduler._update_request_with_output(request, list(tokens))
    grammar = request.structured_output_request.grammar
    assert not kept or grammar.accept_tokens(request.request_id, kept), "the grammar rejects the tokens kept"
    return kept, stopped


def test_a_complete_grammar_ends_its_request_under_ignore_eos_and_min_tokens(compiler: Any) -> None:
    """The EOS that completes the grammar ends the request ("stop", the EOS last, as the detokenizer expects of a
    stop) even where ``ignore_eos`` or an unmet ``min_tokens`` would go on; tokens after it in the step are dropped
    (vLLM went on and failed the request when the finished grammar rejected the next token)."""
    from vllm.v1.request import RequestStatus

    yes, junk = _ids(compiler, "yes"), _ids(compiler, " import")[:1]
    for params in ({"ignore_eos": True}, {"min_tokens": 9}):
        scheduler = _scheduler()
        for step in ([*yes, EOS, *junk], [*yes, EOS]):
            request = _request(compiler, "(yes|no)", max_tokens=48, **params)
            assert _step(scheduler, request, step) == ([*yes, EOS], True), (params, step)
            assert request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason is None
            assert list(request.output_token_ids) == [*yes, EOS]
            assert request.structured_output_request.grammar.is_terminated()


def test_a_grammar_no_token_satisfies_ends_its_request(compiler: Any) -> None:
    """Where another mask leaves the grammar nothing (allowed_token_ids disjoint from it, min_tokens hiding the EOS it
    needs) the sampler emits an arbitrary token: the request stops before it ("length"), with what the grammar
    accepted, whether the dead end comes at the first token, later in a step or at the start of one."""
    from vllm.v1.request import RequestStatus

    scheduler = _scheduler()
    request = _request(compiler, "[0-9]{1,4}", max_tokens=8, allowed_token_ids=[5, 6])
    assert _step(scheduler, request, [EOS]) == ([], True)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED and list(request.output_token_ids) == []
    maybe, x = _ids(compiler, "maybe"), _ids(compiler, "x")
    request = _request(compiler, "(maybe|no)", max_tokens=20, min_tokens=9)
    assert _step(scheduler, request, [*maybe, *x]) == (maybe, True)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED and list(request.output_token_ids) == maybe
    request = _request(compiler, "(maybe|no)", max_tokens=20, min_tokens=9)
    assert _step(scheduler, request, maybe) == (maybe, False)
    assert _step(scheduler, request, x) == ([], True)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED and list(request.output_token_ids) == maybe


def test_tokens_the_grammar_accepts_keep_vllms_stop_rules(compiler: Any) -> None:
    """A step the grammar accepts whole is vLLM's (stopping at max_tokens or EOS as before); so is a grammar still in
    reasoning, which the scheduler does not advance."""
    from vllm.v1.request import RequestStatus

    scheduler = _scheduler()
    digits = _ids(compiler, "1234")
    request = _request(compiler, "[0-9]{1,4}", max_tokens=1)
    assert _step(scheduler, request, digits[:1]) == (digits[:1], True)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    request = _request(compiler, "[0-9]{1,4}", max_tokens=8)
    assert _step(scheduler, request, [*digits[:1], EOS]) == ([*digits[:1], EOS], True)
    assert request.status == RequestStatus.FINISHED_STOPPED
    thinking = _scheduler(reasoning=True)
    request = _request(compiler, "[0-9]{1,4}", reasoning=True, max_tokens=8)
    words = _ids(compiler, "let me think")
    assert thinking._update_request_with_output(request, list(words)) == (words, False)
    assert request.status == RequestStatus.RUNNING
