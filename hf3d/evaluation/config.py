"""What a downstream evaluation runs: the options `hf3d eval`, the `evals:` section of `hf3d train`,
`hf3d.Trainer(eval_tasks=...)` and `hf3d.evaluate_tasks` share."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MAX_LENGTH = 4096  # rows longer than this make dense [S, S] masks of hundreds of MB per row
TOKENS_PER_FORWARD = 8192
PROMPT_STYLES = ("lighteval", "harness")
TOKENIZATIONS = ("pairwise", "joint")


@dataclass
class TaskEvalConfig:
    """Multiple-choice tasks scored in the cloze formulation at the model's own mesh (hf3d/evaluation)."""

    tasks: list[str] = field(default_factory=list)
    """Tasks: JSONL files of {query, choices, gold} rows, tasks hf3d ships (shakespeare-next-line,
    shakespeare-word) or the Hub tasks of the SmolLM suite (hellaswag, arc_easy, arc_challenge, piqa, mmlu,
    commonsense_qa, winogrande, openbookqa, boolq; gsm8k, generative). A file of {query, answer} rows is a
    generative task: greedy generation, exact match on the final number."""
    limit: int | None = None
    """Score only the first N rows of each task."""
    num_fewshot: int = 0
    """Rows of the same task put before each query (its query and right choice each), drawn with fewshot_seed."""
    fewshot_seed: int = 1234
    max_length: int | None = None
    """Tokens one choice may read (its context and continuation but the last token; longer contexts are cut from
    the left) and the length of the packed scoring rows. Default: data.seq_len in hf3d train, else the model's
    max_position_embeddings up to 4096."""
    batch_rows: int | None = None
    """Rows per forward. Default: the rows of a training micro-batch in hf3d train, else 8192 tokens' worth."""
    max_new_tokens: int = 256
    """Generative tasks ({query, answer} rows, gsm8k): tokens generated per row at most (greedy)."""
    stop: list[str] = field(default_factory=lambda: ["\n\n", "Question:"])
    """Generative tasks: the generation of a row ends at the first of these (and the text is cut there)."""
    prompt_style: str = "lighteval"
    """The Hub tasks' prompts: lighteval (lighteval 0.13.0's templates, the rows SmolLM3's evaluation scored) or
    harness (LM Evaluation Harness-style cloze prompts, as SmolLM2's evaluation wrote them)."""
    tokenization: str = "pairwise"
    """How a choice becomes tokens: pairwise (the context and each choice encoded apart, as lighteval 0.13.0's
    transformers backend does) or joint (context + choice encoded together and split at the context's length,
    lighteval's pairwise_tokenization=False and its vLLM backend's default)."""
    log_samples: bool = False
    """Also write samples_<task>.jsonl, one line per row: each choice's log-likelihood, tokens and characters,
    the prediction and the gold index."""

    def __post_init__(self) -> None:
        if isinstance(self.tasks, str):
            self.tasks = [t for t in self.tasks.split(",") if t]
        from .tasks import check_spec

        for spec in self.tasks:  # a misspelt name or a missing file is refused here, before any process starts
            check_spec(spec)
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"the evaluation's limit must be a number of rows >= 1, got {self.limit}")
        if self.num_fewshot < 0:
            raise ValueError(f"the evaluation's num_fewshot must be >= 0, got {self.num_fewshot}")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"the evaluation's max_length must be at least 2 tokens, got {self.max_length}")
        if self.max_new_tokens < 1:
            raise ValueError(f"the evaluation's max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for key, value, allowed in (
            ("prompt_style", self.prompt_style, PROMPT_STYLES),
            ("tokenization", self.tokenization, TOKENIZATIONS),
        ):
            if value not in allowed:
                raise ValueError(f"the evaluation's {key} must be {' or '.join(allowed)}, got {value!r}")
        if self.batch_rows is not None and self.batch_rows < 1:
            raise ValueError(f"the evaluation's batch_rows must be >= 1, got {self.batch_rows}")
