"""Process-0 request-validation seams: inputs vLLM 0.26 lets through but cannot serve are refused with a 400.

* ``InputProcessor._validate_model_input``: vLLM bounds prompt ids by the tokenizer's ``max_token_id``, which its
  cached tokenizer sets to ``vocab_size`` (one past the last id), so the id equal to the model's vocabulary size
  reaches the embedding and kills the engine (an out-of-bounds index in the compiled kernel). Ids at or past the
  model's vocabulary size are refused here.
* ``SamplingParams._validate_spec_decode``: with speculative decoding vLLM's rejection sampler returns
  ``logprob_token_ids`` for the first step only, and the server then fails building the response (a 500). A ddtree
  engine refuses such requests, as vLLM itself refuses ``min_p`` and ``logit_bias``.
"""

from __future__ import annotations

from typing import Any

from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.patches import patch_attr


def _validate_model_input(self: Any, prompt_input: Any, prompt_type: Any) -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    InputProcessor._orig__validate_model_input(self, prompt_input, prompt_type)
    if prompt_input.get("type") == "embeds":
        return
    ids = prompt_input.get("prompt_token_ids") or ()
    vocab_size = self.model_config.get_vocab_size()
    largest = max(ids, default=0)
    if largest >= vocab_size:
        raise ValueError(f"Token id {largest} is out of vocabulary (the model has {vocab_size} tokens)")


def _validate_spec_decode(self: Any, speculative_config: Any) -> None:
    from vllm.sampling_params import SamplingParams

    SamplingParams._orig__validate_spec_decode(self, speculative_config)
    if get_ddtree_config(speculative_config) is not None and self.logprob_token_ids:
        raise ValueError("The logprob_token_ids sampling parameter is not yet supported with speculative decoding.")


def apply() -> None:
    """Install the request-validation seams (idempotent)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    patch_attr(InputProcessor, "_validate_model_input", _validate_model_input)
    patch_attr(SamplingParams, "_validate_spec_decode", _validate_spec_decode)
