"""Structured-output seams: requests vLLM 0.26 fails with a 500 (with or without speculative decoding) are served.

* ``choice_as_grammar`` (the module global of ``v1/structured_output/backend_xgrammar.py`` that
  ``validate_xgrammar_grammar`` calls; the API server process): vLLM writes each choice into an EBNF string literal
  escaping only ``"`` and ``\\``, and xgrammar's lexer refuses a raw line break there. With the default "auto" backend
  such a choice then fell back to guidance, while the engine core builds one backend for its lifetime, from the first
  structured request: after any xgrammar request the engine got a choice its xgrammar backend cannot compile and the
  request ended in an internal error. Line breaks are written as ``\\n`` and ``\\r``, which xgrammar reads back as the
  same characters, so the choice stays on xgrammar.
"""

from __future__ import annotations

from vllm_ddtree.patches import patch_attr

# Characters xgrammar's EBNF lexer refuses inside a string literal, as escapes it reads back as themselves.
_EBNF_LINE_BREAKS = str.maketrans({"\n": "\\n", "\r": "\\r"})


def choice_as_grammar(choice: list[str]) -> str:
    """vLLM's EBNF for a choice, with the line breaks inside its string literals escaped."""
    from vllm.v1.structured_output import backend_xgrammar

    # vLLM's grammar puts nothing but the choices inside quotes, and no line break outside them.
    return backend_xgrammar._orig_choice_as_grammar(choice).translate(_EBNF_LINE_BREAKS)


def apply() -> None:
    """Install the structured-output seams (idempotent; each is inert in the processes that do not run it)."""
    from vllm.v1.structured_output import backend_xgrammar

    patch_attr(backend_xgrammar, "choice_as_grammar", choice_as_grammar)
