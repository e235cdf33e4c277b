"""Rebuild the demo model's byte-level BPE tokenizer (``tokenizer.json`` next to this file).

The committed ``tokenizer.json`` was produced once by running, with Python 3.11.7 and tokenizers 0.23.3::

    python -m hybridlm.demo.train_tokenizer src/hybridlm/demo/tokenizer.json

The corpus is every ``.py`` file of the running interpreter's standard library outside its test suites
(about 14 MB of code plus English docstrings; ``pydoc_data/topics.py`` carries the language reference as
prose), read in sorted path order. Nothing imports this module at run time: the package ships the committed
file, and this script documents and reproduces how it was made.
"""

from __future__ import annotations

import argparse
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

VOCAB_SIZE = 4096  # total, including the added tokens below
# Qwen's convention: the chat-control tokens are "special" (dropped by skip_special_tokens) while the
# reasoning and tool markup tokens are plain added tokens, so decoded text still shows them to output parsers.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
# The Qwen2 pre-tokenization split: contractions, letter runs, single digits, punctuation runs, newlines,
# spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def corpus_files() -> list[Path]:
    """The stdlib ``.py`` files used as training text, sorted so the corpus order is reproducible."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"test", "tests", "site-packages", "idle_test"}
    return sorted(p for p in stdlib.rglob("*.py") if not skipped.intersection(p.relative_to(stdlib).parts))


def _texts(files: list[Path]) -> Iterator[str]:
    for path in files:
        yield path.read_text(encoding="utf-8", errors="replace")


def train(files: list[Path]) -> Tokenizer:
    """Train a Qwen-style byte-level BPE with ``VOCAB_SIZE`` ids; the added tokens take the last ids."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS) - len(MARKUP_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=16,  # keeps runs like "--------" from eating the small vocabulary
        show_progress=False,
    )
    tokenizer.train_from_iterator(_texts(files), trainer=trainer, length=len(files))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="where to write tokenizer.json")
    args = parser.parse_args()
    tokenizer = train(corpus_files())
    tokenizer.save(str(args.output))
    print(f"wrote {args.output}: {tokenizer.get_vocab_size()} ids")


if __name__ == "__main__":
    main()
