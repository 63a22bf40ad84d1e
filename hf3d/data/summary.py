"""The lines a DataPipeline prints at the start of a run: each source, each stage, the eval split, the
packing, and what a resume had to say."""

from __future__ import annotations


def summary_lines(pipe) -> list[str]:
    """`DataPipeline.summary`: the lines for the start of a run."""
    first = pipe.stages[0]  # stages with another seq_len or model setting than the first: each says its own
    varies = any((s.seq_len, s.model_overrides()) != (first.seq_len, first.model_overrides()) for s in pipe.stages)
    rows_of = dict.fromkeys(pipe.sources, 0.0)  # expected rows per source over the run
    lines = []
    for i, stage in enumerate(pipe.stages):
        end = pipe.stages[i + 1].start_step if i + 1 < len(pipe.stages) else pipe.total_steps
        total = sum(s.weight for s in stage.sources)
        parts = ", ".join(f"{s.label} {s.weight / total:.1%}" for s in stage.sources)
        model = "".join(f", {k} {v}" for k, v in stage.model_overrides().items())
        length = f" at seq_len {stage.seq_len}{model}" if varies else ""
        lines.append(f"data stage {stage.name}: {steps_span(stage.start_step + 1, end)}{length}: {parts}")
        for s, view in zip(stage.sources, pipe.stage_views[i]):
            rows_of[view] += (end - stage.start_step) * pipe.global_batch * s.weight / total
    head = []
    for name, src in pipe.sources.items():
        held = src.num_windows - pipe.num_train[name]
        skipped = src.meta.get("skipped_docs", 0)
        head.append(
            f"data source {name} ({src.meta['kind']}, {src.meta['path']}): {src.num_tokens:,} tokens, "
            f"{src.num_docs:,} documents" + (f" ({skipped:,} empty or missing skipped)" if skipped else "") + ", "
            f"{pipe.num_train[name]:,} training windows of {src.window} tokens"
            + (f" (+{held:,} held out for eval)" if held else "")
            + f"; {rows_of[name] / pipe.num_train[name]:.2f} epochs over the run"
        )
    if pipe.eval_every:
        where = (
            f"{pipe.eval_source.num_windows:,} windows of {pipe.cfg.eval.path}"
            if pipe.eval_source
            else f"the last {pipe.cfg.eval.fraction:.1%} of each first-stage source"
        )
        if not pipe.eval_source and len(pipe.eval_names) > 1:  # each source's rows: its eval loss is over these
            shares = zip(pipe.eval_names, pipe.eval_rows_per_source())
            where += " (" + ", ".join(f"{n} {k} row{'s' * (k != 1)}" for n, k in shares) + ")"
        lines.append(
            f"data eval: every {pipe.eval_every} steps, {pipe.cfg.eval.batches} batches of {pipe.eval_batch} "
            f"rows from {where}"
        )
    masking = "document masking" if pipe.cfg.document_masking else "no document masking"
    packing = f"data packing: {_row_lengths(pipe)}, {masking}, seed {pipe.cfg.seed}"
    return head + lines + [packing] + pipe.resume_notes


def _row_lengths(pipe) -> str:
    """The seq_len of the training rows (each stage's, where they differ) and of the eval rows (data.seq_len)."""
    lengths = {s.seq_len for s in pipe.stages}
    if len(lengths) == 1:
        text = f"seq_len {pipe.stages[0].seq_len}"
    else:
        ends = [s.start_step for s in pipe.stages[1:]] + [pipe.total_steps]
        text = "seq_len " + ", ".join(
            f"{s.seq_len} ({steps_span(s.start_step + 1, end)})" for s, end in zip(pipe.stages, ends)
        )
    if pipe.eval_every and lengths != {pipe.cfg.seq_len}:
        text += f"; eval rows of {pipe.cfg.seq_len} (data.seq_len)"
    return text


def steps_span(first: int, last: int) -> str:
    """`step 3` or `steps 3..5`: steps counted from 1, both ends included."""
    return f"step {first}" if first == last else f"steps {first}..{last}"
