"""Client input vLLM 0.26 answers with a 500 (with or without speculative decoding): the seams that answer it with a
400 (a body that is JSON but not an object) or serve it (a choice with a line break)."""

from __future__ import annotations

import json
import subprocess
import sys

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
from vllm.entrypoints.serve.utils.server_utils import exception_handler, validation_exception_handler

app = FastAPI()
app.state.args = Namespace(log_error_stack=False)
app.state.openai_serving_completion = None  # a valid body reaches the handler: 501, no completions here
app.state.openai_serving_chat = None
attach_completion(app)
attach_chat(app)
attach_sagemaker(app, ("generate",), None)
app.exception_handler(RequestValidationError)(validation_exception_handler)
app.exception_handler(Exception)(exception_handler)
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
