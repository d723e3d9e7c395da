"""Process-0 request-validation seams: inputs vLLM 0.26 lets through but cannot serve are refused with a 400.

* ``validate_json_request`` (``entrypoints/serve/utils/api_utils.py``, the dependency of every JSON route, run by
  FastAPI before it validates the body): a body that is JSON but not an object (``[{...}]``, ``5``, ``"x"``) reached
  the request models' ``mode="before"`` validators, which call ``data.get`` on it; the ``AttributeError`` became a 500.
  Such bodies are refused here, as vLLM refuses a body that is not JSON. The routes bind the function when their
  module is imported, which in the API server is after the plugin loads (``build_app``); the SageMaker router, imported
  with ``api_server`` itself, looks the name up in its own module, which is patched too.
* ``InputProcessor._validate_model_input``: vLLM bounds prompt ids by the tokenizer's ``max_token_id``, which its
  cached tokenizer sets to ``vocab_size`` (one past the last id), so the id equal to the model's vocabulary size
  reaches the embedding and kills the engine (an out-of-bounds index in the compiled kernel). Ids at or past the
  model's vocabulary size are refused here.
* ``SamplingParams._validate_spec_decode``: with speculative decoding vLLM's rejection sampler returns
  ``logprob_token_ids`` for the first step only, and the server then fails building the response (a 500). A ddtree
  engine refuses such requests, as vLLM itself refuses ``min_p`` and ``logit_bias``.

Refusals raise ``VLLMValidationError``, which every supported release answers with a 400 (0.26 maps ``ValueError``s
to 400; 0.32 maps only its ``VLLMClientError``s, and a plain ``ValueError`` there is a 500).
"""

from __future__ import annotations

import sys
from typing import Any

from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.patches import patch_attr


def _validate_model_input(self: Any, prompt_input: Any, prompt_type: Any) -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    InputProcessor._orig__validate_model_input(self, prompt_input, prompt_type)
    if prompt_input.get("type") == "embeds":
        return
    ids = prompt_input.get("prompt_token_ids") or ()
    vocab_size = self.model_config.get_vocab_size()
    largest = max(ids, default=0)
    if largest >= vocab_size:
        raise VLLMValidationError(
            f"Token id {largest} is out of vocabulary (the model has {vocab_size} tokens)", parameter="prompt"
        )


def _validate_spec_decode(self: Any, speculative_config: Any) -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    SamplingParams._orig__validate_spec_decode(self, speculative_config)
    if get_ddtree_config(speculative_config) is not None and self.logprob_token_ids:
        raise VLLMValidationError(
            "The logprob_token_ids sampling parameter is not yet supported with speculative decoding.",
            parameter="logprob_token_ids",
        )


_SAGEMAKER_ROUTER = "vllm.entrypoints.serve.sagemaker.api_router"


async def validate_json_request(raw_request: Any) -> None:
    """vLLM's content-type check, then: the body, when there is one and it parses, must be a JSON object."""
    from fastapi.exceptions import RequestValidationError
    from vllm.entrypoints.serve.utils import api_utils

    await api_utils._orig_validate_json_request(raw_request)
    if not await raw_request.body():
        return  # FastAPI answers a missing body itself
    try:
        body = await raw_request.json()  # parsed and cached by FastAPI already
    except ValueError:
        return  # and a malformed one
    if not isinstance(body, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(body), "a number")
        raise RequestValidationError(errors=[f"The request body must be a JSON object, not {kind}"])


def apply() -> None:
    """Install the request-validation seams (idempotent)."""
    from vllm.entrypoints.serve.utils import api_utils
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    patch_attr(InputProcessor, "_validate_model_input", _validate_model_input)
    patch_attr(SamplingParams, "_validate_spec_decode", _validate_spec_decode)
    # FastAPI reads a dependency's parameters from the unwrapped function (``raw_request: Request``, resolved in
    # vLLM's module), so the replacement declares the original as what it wraps.
    original = getattr(api_utils, "_orig_validate_json_request", api_utils.validate_json_request)
    validate_json_request.__wrapped__ = original  # type: ignore[attr-defined]
    patch_attr(api_utils, "validate_json_request", validate_json_request)
    if (sagemaker := sys.modules.get(_SAGEMAKER_ROUTER)) is not None:
        patch_attr(sagemaker, "validate_json_request", validate_json_request)
