"""Text cut by characters before it is tokenised: only the part a model can read is ever encoded.

Tokenising costs about 165 times the text's size in memory, so a context of megabytes cut to max_length tokens
after encoding costs gigabytes. A token spans at most as many characters as its longest vocabulary entry (byte-level
and SentencePiece entries are at least as long as the text they decode to), so the last `n` tokens of a text lie in
its last `n` times that many characters. The cut keeps twice that (room for normalisers that join characters) plus
a margin, so the word the cut splits is encoded far from the tokens that are kept: the last `n` tokens of the cut
text are those of the whole text."""

from __future__ import annotations

MARGIN_CHARS = 1024
_LENGTH_WARNING = "sequence-length-is-longer-than-the-specified-maximum"  # transformers: said once a tokenizer


def load_tokenizer(path: str):
    """The tokenizer of `path` (AutoTokenizer), as hf3d's commands read text with it: without transformers' warning
    that a text is longer than the model's maximum length ("... will result in indexing errors"), which hf3d's own
    checks make wrong or late (training documents are cut into windows, an evaluation context is cut to its window,
    a prompt over the model's positions is refused in hf3d's one line)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    warned = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(warned, dict):  # the warning is given once a tokenizer: given already
        warned[_LENGTH_WARNING] = True
    return tokenizer


def token_span(tokenizer) -> int:
    """The most characters one token of `tokenizer` spans (its longest vocabulary entry, added tokens included)."""
    cached = getattr(tokenizer, "_hf3d_token_span", None)
    if cached is None:
        cached = max((len(t) for t in tokenizer.get_vocab()), default=1) or 1
        try:
            tokenizer._hf3d_token_span = cached
        except AttributeError:  # a tokenizer that takes no attributes: measured again next time
            pass
    return cached


def chars_for(tokens: int, tokenizer) -> int:
    """How many trailing characters of a text surely hold its last `tokens` tokens."""
    return 2 * (tokens + 1) * token_span(tokenizer) + MARGIN_CHARS


def cut_left(text: str, tokens: int, tokenizer) -> tuple[str, bool]:
    """(`text`'s trailing characters that hold its last `tokens` tokens, whether any were cut)."""
    keep = chars_for(tokens, tokenizer)
    return (text[-keep:], True) if len(text) > keep else (text, False)
