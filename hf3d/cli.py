"""The `hf3d` command (also `python -m hf3d`)."""

from __future__ import annotations

import argparse
import os
import sys

from .parallel.config import DTYPE_NAMES
from .plan.command import add_parser as plan_parser

SET_HELP = "override config values (repeatable: every --set counts)"
MESH_HELP = "the mesh, e.g. parallel.tp=2 parallel.pp=2 (repeatable: every --set counts)"


def _is_main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _launch_option(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "launching (torchrun's flags and meaning; under torchrun or accelerate launch leave them out)"
    )
    g.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="start N worker processes on this machine (as torchrun does) and end cleanly: Ctrl-C leaves the "
        "workers' last line on screen and exits 130; a failure is one line",
    )
    g.add_argument("--nnodes", metavar="N|MIN:MAX", help="machines in the job (MIN:MAX: elastic; default 1)")
    g.add_argument("--node-rank", type=int, metavar="R", help="this machine's rank (the static backend's)")
    g.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="where the nodes meet: a machine that outlives the job")
    g.add_argument("--rdzv-id", metavar="ID", help="the job's id, the same on every node")
    g.add_argument("--rdzv-backend", metavar="c10d|etcd-v2|static", help="the rendezvous (default c10d)")
    g.add_argument("--rdzv-conf", metavar="KEY=VALUE,...", help="the rendezvous' options, e.g. last_call_timeout=5")
    g.add_argument(
        "--max-restarts",
        type=int,
        metavar="K",
        help="restart the workers up to K times after a failure (they resume from the newest checkpoint)",
    )


def _launch_options(args):
    """The launch flags given on the command line (LaunchOptions), or None when there are none."""
    from .utils.launch import LaunchOptions

    given = {
        flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"), None) for flag in LaunchOptions.FLAGS
    }
    given = {k: v for k, v in given.items() if v is not None}
    return LaunchOptions(**given) if given else None


def _launch(parser: argparse.ArgumentParser, args, options, argv: list[str]) -> int:
    """The launch flags: check what can be checked here (one line, no worker started), then run the command on
    this node's workers (utils.launch)."""
    from .utils.launch import launch, worker_argv

    options.config()  # the flags themselves first
    if args.func is _train:
        from .train.config import TrainConfig

        TrainConfig.from_yaml(args.config, args.set or [])
    else:  # eval, generate
        from .model_source import check_model

        if args.func is _generate:
            from .generation.command import read_prompts

            read_prompts(args.prompt, args.prompts)
        check_model(args.model, scratch=args.func is _eval)
    workers = worker_argv(argv)
    if _launch_options(parser.parse_args(workers)) is not None:  # an abbreviation argparse accepted
        raise ValueError("spell the launch flags in full (--nproc-per-node N, ...): the workers' command line "
                         "leaves them out")  # fmt: skip
    return launch(f"hf3d {args.command}", options, workers)


def _collective(command: str, body, *, steps: bool) -> int:
    """Run `body(state)` as a command of every rank: it ends with 0, or the code of faults.fail (one line for
    the whole job, no rank left waiting on a dead peer). A command that got as far as its process group leaves
    through faults.leave (or faults.fail), under a launcher or not: no interpreter teardown, which with gloo's
    threads up can abort and turn 0 into 134 (it did so in a one-process run, its process group destroyed
    first). steps: the command trains in steps (a failure names its step)."""
    from .utils.faults import RunState, die_with_parent, fail, interrupted, leave, started_by_launcher

    if started_by_launcher():  # before anything slow: a launcher killed from now on takes this worker along
        die_with_parent()
    state = RunState(steps=steps)
    try:
        body(state)
    except Exception as e:
        return fail(e, state, command)  # it returns only before the process group
    except KeyboardInterrupt:  # Ctrl-C before training's own handler, or in eval / generate: one line
        return interrupted(command, state)
    leave(0)


def _train(args) -> int:
    """`hf3d train`; a signal ends it with 128 + N (trainer.StopSignal)."""

    def body(state) -> None:
        from .train.config import TrainConfig

        cfg = TrainConfig.from_yaml(args.config, args.set or [])  # a bad config fails before the slow imports
        p = cfg.parallel
        state.place(p.tp, p.pp, int(os.environ.get("WORLD_SIZE", "1")), cp=p.cp)
        from .train.trainer import train

        train(cfg, state=state)

    return _collective("hf3d train", body, steps=True)


def _eval(args) -> int:
    def body(state) -> None:
        import torch

        from .evaluation.command import parallel_config, run_eval
        from .evaluation.config import TaskEvalConfig

        cfg = TaskEvalConfig(
            tasks=args.tasks,
            limit=args.limit,
            num_fewshot=args.num_fewshot,
            fewshot_seed=args.fewshot_seed,
            max_length=args.max_length,
            batch_rows=args.batch_rows,
            max_new_tokens=args.max_new_tokens,
            stop=list(args.stop),
            prompt_style=args.prompt_style,
            tokenization=args.tokenization,
            log_samples=args.log_samples,
        )
        run_eval(
            args.model,
            cfg,
            output_dir=args.output_dir,
            pcfg=parallel_config(args.set or []),
            dtype=getattr(torch, args.dtype),
            attn_implementation=args.attn_implementation,
            state=state,
        )

    return _collective("hf3d eval", body, steps=False)


def _generate(args) -> int:
    def body(state) -> None:
        import torch

        from .evaluation.command import parallel_config
        from .generation.command import read_prompts, run_generate, sampling_options

        prompts = read_prompts(args.prompt, args.prompts)  # checked before any model work
        options = sampling_options(args)
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
        run_generate(
            args.model,
            prompts,
            pcfg=parallel_config(args.set or []),
            options=options,
            max_new_tokens=args.max_new_tokens,
            output=args.output,
            dtype=getattr(torch, args.dtype),
            attn=args.attn_implementation,
            stop_strings=args.stop,
            state=state,
        )

    return _collective("hf3d generate", body, steps=False)


def _generate_parser(sub) -> None:
    """`hf3d generate`'s arguments."""
    p = sub.add_parser(
        "generate",
        help="generate text at any mesh from a checkpoint, an HF folder or a Hub id (greedy unless a sampling "
        "option is given); on several processes (--nproc-per-node N, or torchrun) for tp / pp / dp / cp / ep",
    )
    p.add_argument("model", help="hf3d checkpoint (saved at any mesh), HF model directory or Hub id")
    p.add_argument("--prompt", help="one prompt")
    p.add_argument("--prompts", metavar="FILE", help='a JSONL file, one {"prompt": TEXT} per line')
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    p.add_argument("--output", metavar="OUT.jsonl", help='write {"prompt", "generated_ids", "text"} per prompt')
    p.add_argument("--do-sample", action="store_true", help="sample (stock's defaults: temperature 1, top-k 50)")
    p.add_argument("--temperature", type=float, help="sampling temperature (implies --do-sample)")
    p.add_argument("--top-k", type=int, help="sample among the k likeliest tokens (implies --do-sample)")
    p.add_argument("--top-p", type=float, help="sample within top-p probability mass (implies --do-sample)")
    p.add_argument("--seed", type=int, help="sampling seed: each prompt draws the same tokens at any mesh")
    p.add_argument("--stop", nargs="*", metavar="TEXT", help="stop a prompt's generation once it has written TEXT")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32", help="weights and activations (default fp32)")
    p.add_argument("--attn-implementation", default="auto", help="sdpa, eager, flash_attention_2, ... (default auto)")
    p.add_argument("--set", nargs="*", action="extend", metavar="parallel.KEY=VALUE", help=MESH_HELP)
    _launch_option(p)
    p.set_defaults(func=_generate)


def _plan(args) -> int:
    """`hf3d plan`: a train YAML read here (hf3d/plan sits below the trainer), the rest in hf3d/plan/command.py."""
    from .plan.command import run

    if args.source.endswith((".yaml", ".yml")):
        from .train.config import TrainConfig

        args.train_config = TrainConfig.from_yaml(args.source)
    return run(args)


def _to_hf(args) -> None:
    from .checkpoint.convert import checkpoint_to_hf

    print(f"wrote {checkpoint_to_hf(args.ckpt, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size)}")


def _from_hf(args) -> None:
    from .checkpoint.convert import hf_to_checkpoint

    print(f"wrote {hf_to_checkpoint(args.src, args.out, fsync=args.fsync)}")


def _average(args) -> None:
    from .checkpoint.average import average_checkpoints

    out = average_checkpoints(args.ckpts, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size)
    print(f"wrote {out}: the mean of {len(args.ckpts)} checkpoints ({args.dtype})")


def _average_parser(sub) -> None:
    """`hf3d average`'s arguments (no import of torch: `hf3d --help` answers without it)."""
    p = sub.add_parser(
        "average",
        help="the mean of several checkpoints' weights (e.g. the last ones of a WSD decay) as an HF directory, "
        "on one CPU process",
    )
    p.add_argument("ckpts", nargs="+", metavar="CKPT", help="hf3d checkpoint folders (2 or more, any mesh each)")
    p.add_argument("--out", required=True, help="HF directory to write (replaced if it is one already)")
    p.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="output weights dtype (default bfloat16; "
        "the mean is summed in float32 either way)"
    )  # fmt: skip
    p.add_argument("--max-shard-size", default="5GB", help="shard the safetensors past this size: 5GB, 500MB, bytes")
    p.set_defaults(func=_average)


def _push(args) -> None:
    from .hf.hub import push_to_hub

    url = push_to_hub(
        args.model_dir,
        args.repo_id,
        private=args.private,
        revision=args.revision,
        commit_message=args.commit_message,
        retries=args.retries,
        retry_wait_s=args.retry_wait,
    )
    print(f"pushed {args.model_dir} to {args.repo_id}: {url}")


def _eval_parser(sub) -> None:
    """`hf3d eval`'s arguments."""
    p = sub.add_parser(
        "eval",
        help="score multiple-choice tasks (cloze) at any mesh, from a checkpoint, an HF folder or a Hub id; "
        "on several processes (--nproc-per-node N, or torchrun) for tp / pp / dp / cp / ep",
    )
    p.add_argument("model", help="hf3d checkpoint (saved at any mesh), HF model directory or Hub id")
    p.add_argument(
        "--tasks",
        required=True,
        help="comma-separated tasks: JSONL files of {query, choices, gold} rows, or names: shakespeare-next-line, "
        "shakespeare-word (shipped), hellaswag, arc_easy, arc_challenge, piqa, mmlu, commonsense_qa, winogrande, "
        "openbookqa, boolq (Hub datasets; lighteval's names too: hellaswag_cf, arc_cf:easy, ...); TASK:mc scores "
        "a multiple-choice task in the lettered formulation (' A. ...' lines, the letters scored); NAME=FILE "
        "scores a Hub task from a JSONL of its dataset's rows (hf3d fetch-tasks --raw-dir writes one)",
    )
    p.add_argument("--output-dir", required=True, help="folder for results.json (and samples_<task>.jsonl)")
    p.add_argument("--log-samples", action="store_true", help="also write samples_<task>.jsonl, a line per row")
    p.add_argument("--limit", type=int, help="score only the first N rows of each task")
    p.add_argument("--num-fewshot", type=int, default=0, help="rows of the same task before each query (default 0)")
    p.add_argument("--fewshot-seed", type=int, default=1234, help="seed of the few-shot draws")
    p.add_argument(
        "--max-length",
        type=int,
        help="tokens one choice may read, context cut from the left beyond (default: the model's "
        "max_position_embeddings, at most 4096); also the length of the packed rows",
    )
    p.add_argument("--batch-rows", type=int, help="rows per forward (default: 8192 tokens' worth)")
    p.add_argument(
        "--prompt-style",
        default="lighteval",
        help="the Hub tasks' prompts: lighteval (default: lighteval 0.13.0's templates, as SmolLM3's evaluation) "
        "or harness (LM Evaluation Harness-style cloze prompts, as SmolLM2's)",
    )
    p.add_argument(
        "--tokenization",
        default="pairwise",
        help="pairwise (default: context and each choice encoded apart, lighteval 0.13.0's transformers backend) "
        "or joint (context + choice encoded together and split, lighteval's vLLM backend)",
    )
    p.add_argument("--max-new-tokens", type=int, default=256, help="generative tasks: tokens per answer (256)")
    p.add_argument(
        "--stop", nargs="*", default=["\n\n", "Question:"], metavar="TEXT", help="generative tasks: stop strings"
    )
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32", help="weights and activations (default fp32)")
    p.add_argument("--attn-implementation", default="auto", help="sdpa, eager, flash_attention_2, ... (default auto)")
    p.add_argument("--set", nargs="*", action="extend", metavar="parallel.KEY=VALUE", help=MESH_HELP)
    _launch_option(p)
    p.set_defaults(func=_eval)


def _fetch_tasks(args) -> int:
    from .evaluation.config import TaskEvalConfig
    from .evaluation.tasks import fetch_tasks

    TaskEvalConfig(prompt_style=args.prompt_style)  # an unknown style is refused in one line
    for line in fetch_tasks(args.tasks, prompt_style=args.prompt_style, raw_dir=args.raw_dir):
        print(f"hf3d fetch-tasks: {line}")
    return 0


def _fetch_tasks_parser(sub) -> None:
    p = sub.add_parser(
        "fetch-tasks",
        help="download Hub tasks' datasets into the HF cache ahead of an evaluation (and, with --raw-dir, their rows "
        "as JSONL files that `--tasks NAME=FILE` scores where the Hub cannot be reached)",
    )
    p.add_argument("tasks", help="comma-separated Hub task names: hellaswag, arc_easy, mmlu, ... (TASK:mc too)")
    p.add_argument("--prompt-style", default="lighteval", help="whose split to fetch: lighteval (default) or harness")
    p.add_argument("--raw-dir", help="also write each task's dataset rows, as they are, to RAW_DIR/<task>.jsonl")
    p.set_defaults(func=_fetch_tasks)


def build_parser() -> argparse.ArgumentParser:
    """The `hf3d` command line: every subcommand and option (each with its help text)."""
    parser = argparse.ArgumentParser(prog="hf3d", description="3D-parallel training of stock transformers models")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "train",
        help="train from a YAML config; on several processes with --nproc-per-node N, on several machines with "
        "--nnodes (or under torchrun, accelerate launch)",
    )
    p.add_argument("config", nargs="?", help="YAML config (default: the embedded tiny SmolLM run)")
    p.add_argument("--set", nargs="*", action="extend", metavar="SECTION.KEY=VALUE", help=SET_HELP)
    _launch_option(p)
    p.set_defaults(func=_train)
    _eval_parser(sub)
    _fetch_tasks_parser(sub)
    _generate_parser(sub)
    p = sub.add_parser("convert", help="hf3d checkpoint <-> HF directory, on one CPU process (no torchrun)")
    directions = p.add_subparsers(dest="direction", required=True)
    d = directions.add_parser("to-hf", help="hf3d checkpoint -> HF directory, on one CPU process")
    d.add_argument("ckpt", help="hf3d checkpoint folder (any mesh; training or weights-only)")
    d.add_argument("out", help="HF directory to write (replaced if it is one already)")
    d.add_argument("--dtype", choices=DTYPE_NAMES, help="weights dtype (default: the checkpoint's training dtype)")
    d.add_argument("--max-shard-size", default="5GB", help="shard the safetensors past this size: 5GB, 500MB, bytes")
    d.set_defaults(func=_to_hf)
    d = directions.add_parser("from-hf", help="HF model -> weights-only hf3d checkpoint")
    d.add_argument("src", help="HF model directory or Hub id (safetensors weights)")
    d.add_argument("out", help="checkpoint folder to write (replaced if it is an hf3d checkpoint already)")
    d.add_argument(
        "--fsync",
        action="store_true",
        help="fsync the files before the checkpoint is marked complete (default: left to the page cache, as "
        "save_pretrained does; every load checks the marker's checksums)",
    )
    d.set_defaults(func=_from_hf)
    _average_parser(sub)
    plan_parser(sub, _plan)
    p = sub.add_parser("push", help="upload an HF model directory to the Hub, with a model card")
    p.add_argument("model_dir", help="HF model directory (config.json + *.safetensors)")
    p.add_argument("repo_id", help="Hub repo, NAMESPACE/NAME; created if missing")
    p.add_argument("--private", action="store_true", help="make a new repo private (an existing one keeps its setting)")
    p.add_argument("--revision", help="branch to commit to (created if missing; default: main)")
    p.add_argument("--commit-message", help='the commit\'s message (default: "Upload <folder name> with hf3d")')
    p.add_argument("--retries", type=int, default=3, help="retries on connection errors and 5xx answers")
    p.add_argument("--retry-wait", type=float, default=1.0, help="seconds before the first retry, doubling after")
    p.set_defaults(func=_push)
    for subparsers in (sub, directions):  # `hf3d X --help` opens with what `hf3d --help` says of X
        for choice in subparsers._choices_actions:
            subparsers.choices[choice.dest].description = choice.help
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    try:
        options = _launch_options(args)
        if options is not None:
            return _launch(parser, args, options, argv)
        code = args.func(args)
    except (ValueError, FileNotFoundError) as e:
        if _is_main_rank():
            print(f"hf3d {args.command}: error: {e}", file=sys.stderr)
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
