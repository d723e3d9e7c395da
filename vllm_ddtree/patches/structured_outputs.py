"""Structured-output seams: requests vLLM 0.26 fails with a 500 (with or without speculative decoding) are served.

* ``choice_as_grammar`` (the module global of ``v1/structured_output/backend_xgrammar.py`` that
  ``validate_xgrammar_grammar`` calls; the API server process): vLLM writes each choice into an EBNF string literal
  escaping only ``"`` and ``\\``, and xgrammar's lexer refuses a raw line break there. With the default "auto" backend
  such a choice then fell back to guidance, while the engine core builds one backend for its lifetime, from the first
  structured request: after any xgrammar request the engine got a choice its xgrammar backend cannot compile and the
  request ended in an internal error. Line breaks are written as ``\\n`` and ``\\r``, which xgrammar reads back as the
  same characters, so the choice stays on xgrammar.
* ``Scheduler._update_request_with_output`` (the engine core): after it, the scheduler advances a request's grammar by
  the step's tokens and ends the request with FINISHED_ERROR (a 500) when the grammar rejects one. Under the grammar's
  bitmask that happens only when no token could satisfy the request: once the grammar has accepted EOS, ``ignore_eos``
  or an unmet ``min_tokens`` keeps the request going and the next token, sampled unconstrained, is one the finished
  grammar rejects; where the grammar and another mask leave every logit at -inf (``allowed_token_ids`` disjoint from
  the grammar, ``min_tokens`` hiding the EOS the grammar needs) the sampler emits an arbitrary token. The step's
  tokens are now cut where the grammar ends them, and the request stops there: after a stop token the grammar accepted
  (its end: finish reason "stop", as at EOS), or before the first token it rejects (a dead end: finish reason
  "length", with the text the grammar accepted). A complete grammar thus ends its request whatever ``ignore_eos`` and
  ``min_tokens`` say, and no answer holds a token its grammar rejects.
"""

from __future__ import annotations

from typing import Any

from vllm_ddtree.patches import patch_attr, versions

# Characters xgrammar's EBNF lexer refuses inside a string literal, as escapes it reads back as themselves.
_EBNF_LINE_BREAKS = str.maketrans({"\n": "\\n", "\r": "\\r"})


def choice_as_grammar(choice: list[str]) -> str:
    """vLLM's EBNF for a choice, with the line breaks inside its string literals escaped."""
    from vllm.v1.structured_output import backend_xgrammar

    # vLLM's grammar puts nothing but the choices inside quotes, and no line break outside them.
    return backend_xgrammar._orig_choice_as_grammar(choice).translate(_EBNF_LINE_BREAKS)


def _grammar_cut(scheduler: Any, request: Any, new_token_ids: list[int]) -> tuple[int, Any] | None:
    """Where the request's grammar ends the step's tokens, and the status the request then stops with; None where
    the grammar takes them all and none ends it.

    A stop token the grammar accepts (EOS, which xgrammar accepts only where the grammar is complete) ends it there:
    FINISHED_STOPPED, as at a plain EOS, so the detokenizer leaves that last token out of the text. A token the
    grammar rejects with no such end before it is a dead end: the request stops with FINISHED_LENGTH_CAPPED after
    the tokens the grammar accepted (with "stop", the detokenizer would drop the last of them as a stop token).
    Looked at only where the scheduler will advance the grammar by exactly these tokens
    (``versions.grammar_takes_whole_step``: no reasoning parser, reasoning constrained too, or reasoning that ended
    before this step; ``should_advance`` is not called here, since it records reasoning ends as it looks)."""
    from vllm.v1.request import RequestStatus
    from vllm.v1.structured_output.backend_types import StructuredOutputGrammar

    structured = request.structured_output_request
    if not new_token_ids or structured is None:
        return None
    if not versions.grammar_takes_whole_step(scheduler.structured_output_manager, structured):
        return None
    grammar = structured.grammar
    if not isinstance(grammar, StructuredOutputGrammar):
        return None
    accepted = len(grammar.validate_tokens(new_token_ids))  # leaves the grammar where it was
    stops = request.sampling_params.all_stop_token_ids  # EOS even under ignore_eos
    for i in range(accepted):
        if new_token_ids[i] in stops:
            return i + 1, RequestStatus.FINISHED_STOPPED
    if accepted < len(new_token_ids):
        return accepted, RequestStatus.FINISHED_LENGTH_CAPPED
    return None


def _update_request_with_output(
    self: Any, request: Any, new_token_ids: list[int], *args: Any, **kwargs: Any
) -> tuple[list[int], bool]:
    """vLLM's append-and-check-stop over the step's tokens up to where the grammar ends them; the request stops
    there (its grammar is complete, or nothing could satisfy it) instead of failing in the scheduler. Further
    arguments (0.32's ``is_stale``) pass through."""
    from vllm.v1.core.sched.scheduler import Scheduler

    cut = _grammar_cut(self, request, new_token_ids)
    if cut is None:
        return Scheduler._orig__update_request_with_output(self, request, new_token_ids, *args, **kwargs)
    keep, status = cut
    kept, stopped = Scheduler._orig__update_request_with_output(self, request, new_token_ids[:keep], *args, **kwargs)
    if not stopped:  # vLLM's own rules did not end it first (ignore_eos, min_tokens, a dead end)
        request.status = status
    return kept, True


def apply() -> None:
    """Install the structured-output seams (idempotent; each is inert in the processes that do not run it)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import backend_xgrammar

    patch_attr(backend_xgrammar, "choice_as_grammar", choice_as_grammar)
    patch_attr(Scheduler, "_update_request_with_output", _update_request_with_output)
