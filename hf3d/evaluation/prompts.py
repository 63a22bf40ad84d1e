"""The prompts of lighteval 0.13.0's English templates, as the strings its models score: the cloze formulation
(CF: each answer's text is a continuation) and the lettered one (MCF: the answers listed as " A. ...", the letters
the continuations), after its prompt preparation.

Read from lighteval 0.13.0 (`lighteval/tasks/templates/`: multichoice.py, continuation.py, hellaswag.py, boolq.py,
utils/formulation.py, utils/formatting_utils.py, utils/translation_literals.py; `lighteval/tasks/prompt_manager.py`,
PromptManager._prepare_plain_text). English's literals make its punctuation fixes plain right-strips ("?" stays
"?") and its word and sentence spaces one space each.

- The question template (ARC, PIQA, MMLU, CommonsenseQA, OpenBookQA, BoolQ): an optional context line, then
  "Question: <question>\\nAnswer:"; the context, the question and each answer lose their trailing whitespace and
  have their first letter capitalised; each answer is scored after one space.
- The continuation template (HellaSwag, Winogrande): the context, right-stripped and capitalised; each
  continuation right-stripped and its first letter capitalised after a context that ends a sentence (. ? ! : ;)
  or a line, lower-cased otherwise; each scored after one space.
- Lettered, either template lists the answers as " A. <answer>" lines before "Answer:" and scores " A", " B", ...
- The preparation: a template given an instruction (the continuation template and BoolQ's are given an empty
  one) makes the prompt that instruction, a blank line, and the query stripped of surrounding whitespace
  ("\\n\\n" + query.strip()); without one (the question template's tasks) the query is read as it is.
"""

from __future__ import annotations

import re
import string

LETTERS = string.ascii_uppercase
SENTENCE_END = (".", "?", "!", ":", ";")


def capitalize(text: str) -> str:
    """The first character upper-cased, the rest as it is (str.capitalize would lower-case the rest)."""
    return text[:1].upper() + text[1:]


def decapitalize(text: str) -> str:
    return text[:1].lower() + text[1:]


def fix_capitalization(prefix: str, text: str) -> str:
    """`text` capitalised after an empty prefix, a line break or a sentence's end; lower-cased first otherwise."""
    if not prefix or prefix.endswith("\n") or prefix.rstrip().endswith(SENTENCE_END):
        return capitalize(text)
    return decapitalize(text)


def prepared(query: str, instruction: str | None) -> str:
    """The text a model reads for a query and its template's instruction (None: the template set none)."""
    if instruction is None:
        return query
    if query.startswith(instruction):
        query = query[len(instruction) :].strip()
    return f"{instruction}\n\n{query}"


def options(answers: list[str]) -> str:
    """The lettered list, a line per answer: " A. <answer>\\n"."""
    if len(answers) > len(LETTERS):
        raise ValueError(f"{len(answers)} choices: the lettered formulation has {len(LETTERS)} letters")
    return "".join(f" {LETTERS[i]}. {a}\n" for i, a in enumerate(answers))


def letters(n: int) -> list[str]:
    return [f" {LETTERS[i]}" for i in range(n)]


def question(
    text: str, answers: list, gold: int, *, context: str | None = None, instruction: str | None = None,
    lettered: bool = False,
) -> dict:  # fmt: skip
    """A row of the question template."""
    head = f"{instruction}\n" if instruction else ""
    lead = f"{capitalize(context.rstrip())}\n" if context else ""
    texts = [capitalize(str(a).rstrip()) for a in answers]
    listed = options(texts) if lettered else ""
    query = f"{head}{lead}Question: {capitalize(text.rstrip())}\n{listed}Answer:"
    choices = letters(len(texts)) if lettered else [f" {t}" for t in texts]
    return {"query": prepared(query, instruction), "choices": choices, "gold": gold}


def continuation(context: str, continuations: list[str], gold: int, *, lettered: bool = False) -> dict:
    """A row of the continuation template (its instruction is the empty one)."""
    context = capitalize(context.rstrip())
    texts = [fix_capitalization(context, c.rstrip()) for c in continuations]
    if lettered:
        query, choices = f"{context}\n{options(texts)}Answer:", letters(len(texts))
    else:
        query, choices = context, [f" {t}" for t in texts]
    return {"query": prepared(query, ""), "choices": choices, "gold": gold}


def hellaswag_clean(text: str) -> str:
    """LM Evaluation Harness's cleaning of HellaSwag's WikiHow artifacts as lighteval's template runs it: " [title]"
    becomes ". ", other bracketed markers go, a double space becomes one (one pass), then its `truncate_dots`,
    a literal replace of the three characters backslash, dot, plus (not a regex), and a strip."""
    text = text.replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    text = text.replace("  ", " ")
    text = text.replace("\\.+", "\\.")
    return text.strip()


def hellaswag(activity_label: str, ctx_a: str, ctx_b: str, endings: list[str], gold: int, *, lettered: bool):
    """lighteval's HellaSwag template: "<Label>:\\n" then ctx_a and ctx_b, each cleaned and capitalised, joined
    by a space (ctx_b lower-cased first unless ctx_a ends a sentence); the cleaned endings as continuations.
    None when an ending cleans to nothing (lighteval skips the row)."""
    label = f"{capitalize(activity_label)}:\n" if activity_label else ""
    first, second = capitalize(hellaswag_clean(ctx_a)), capitalize(hellaswag_clean(ctx_b))
    if second:
        first = f"{first.rstrip()} {fix_capitalization(first, second)}"
    cleaned = [hellaswag_clean(e) for e in endings]
    if any(not c.strip() for c in cleaned):
        return None
    return continuation(label + first, cleaned, gold, lettered=lettered)
