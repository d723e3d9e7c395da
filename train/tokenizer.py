"""Byte-level BPE tokenizer + tokenized train/held-out splits of the Python standard library's own source.

Why: the stdlib ships with every interpreter, so the embedded models train and evaluate on real text that is
available offline everywhere. Files are sorted and the split is fixed by module name, so the result is deterministic.

    python train/tokenizer.py --out models/stdlib-qwen3-tiny
"""

from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path

import numpy as np

VOCAB_SIZE = 4096
EOT, MASK = "<|endoftext|>", "<|mask|>"  # ids 0 and 1; MASK never occurs in text (special, not in any merge)
DATA_DIR = Path.home() / ".cache" / "vllm-ddtree" / "stdlib-data"
HELD_OUT_DIRS = ("json", "email")
HELD_OUT_FILES = ("textwrap.py", "shlex.py", "fractions.py", "csv.py", "argparse.py", "pprint.py")
SKIP_PARTS = {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "__pycache__"}


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(train, held_out) stdlib .py files, sorted; tests, codec tables and generated config are skipped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if SKIP_PARTS & set(rel.parts) or rel.name.startswith("_sysconfigdata"):
            continue
        is_held = rel.parts[0] in HELD_OUT_DIRS or (len(rel.parts) == 1 and rel.name in HELD_OUT_FILES)
        (held if is_held else train).append(p)
    return train, held


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path]):  # -> PreTrainedTokenizerFast
    """Byte-level BPE with EOT=0 and MASK=1; saved with a minimal chat template so vLLM's chat path works."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOT, MASK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((read(p) for p in files), trainer=trainer, length=len(files))
    assert tok.token_to_id(EOT) == 0 and tok.token_to_id(MASK) == 1 and tok.get_vocab_size() == VOCAB_SIZE
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT)
    fast.add_special_tokens({"additional_special_tokens": [MASK]})
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    return fast


def encode_split(fast, files: list[Path]) -> np.ndarray:
    """One uint16 stream: EOT, then each file's tokens, each file followed by EOT (documents separated by EOT)."""
    ids: list[int] = [0]
    for p in files:
        ids.extend(fast(read(p), add_special_tokens=False)["input_ids"])
        ids.append(0)
    return np.asarray(ids, dtype=np.uint16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="models/stdlib-qwen3-tiny")
    args = ap.parse_args()
    t0 = time.time()
    train, held = stdlib_files()
    fast = train_tokenizer(train)
    fast.save_pretrained(args.out)
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    for name, files in (("train", train), ("heldout", held)):
        arr = encode_split(fast, files)
        arr.tofile(DATA_DIR / f"{name}.u16")
        print(f"{name}: {len(files)} files, {arr.size} tokens, {sum(p.stat().st_size for p in files)} bytes")
    print(f"tokenizer -> {args.out}, data -> {DATA_DIR} ({time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
