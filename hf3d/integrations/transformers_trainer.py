"""transformers' Trainer driving hf3d at any (tp, pp, dp): `hf3d.Trainer(model=pmodel, args=..., train_dataset=...)`.

A plain Trainer breaks on an hf3d model in a few places (measured): it writes the model and the optimizer from
rank 0 alone (the other ranks' shards are lost, and the export crashes on "tensors share memory"), splits the
data over every process (tp/pp peers of one replica get different rows), rescales the loss by world/tp through
`num_items_in_batch`, clips through accelerate (which sees no gradients: the logged grad norm is 0) and never
calls `optimizer.zero_grad()`. This subclass changes exactly those places and keeps the rest of the stock loop
(logging, callbacks, LR schedulers, checkpoint rotation, trainer_state.json, RNG files):

- the model is marked prepared, so accelerate adds no DDP (DESIGN decision 10); its forward in train mode runs
  the whole step (every micro-batch, forward and backward) and returns the global-batch loss, equal on every
  rank, so the Trainer's backward is a no-op and its loss average over processes is that loss;
- data is sharded over dp only: `per_device_train_batch_size` is the rows of one dp replica per step;
- the optimizer is `hf3d.build_optimizer` with stock's class, arguments and weight-decay rule; it clips with
  the global norm inside `step()`, and the logged grad_norm is its pre-clip global norm;
- `save_model` is a collective HF export; checkpoints hold hf3d's sharded checkpoint under `hf3d/` next to the
  stock files, and `resume_from_checkpoint` reads it at any mesh;
- `evaluate()` reports the token-mean loss over the whole eval set (dp-reduced) and its perplexity, and with
  `eval_tasks` the downstream multiple-choice scores at the model's mesh (hf3d/evaluation).
"""

from __future__ import annotations

import copy
import dataclasses
import io
import math
from itertools import islice
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset
from transformers import Trainer as HFTrainer
from transformers import TrainingArguments
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME
from transformers.trainer_utils import EvalLoopOutput

from ..checkpoint.load import load_checkpoint
from ..checkpoint.marker import is_complete
from ..checkpoint.save import save_checkpoint
from ..checkpoint.untrusted import load_small
from ..evaluation.config import TaskEvalConfig
from ..evaluation.evaluator import Evaluator, load_tasks
from ..hf.folders import EXPORT, is_weights_file
from ..model import IGNORE_INDEX, ParallelModel
from ..optim.build import build_optimizer
from ..optim.zero import ParallelOptimizer
from ..parallel.sharding import training_args_settings
from ..utils import files
from .accelerate import CHECKPOINT_SUBDIR, check_accelerator, check_request

EXPORT_STAGING = ".hf3d-export"  # save_model writes here first: hf3d's export replaces its whole target folder


def check_training_args(args: TrainingArguments, pmodel: ParallelModel) -> None:
    """Refuse TrainingArguments hf3d cannot honour, each with what to do instead."""
    if args.gradient_accumulation_steps != 1:
        raise ValueError(
            f"gradient_accumulation_steps={args.gradient_accumulation_steps}: hf3d accumulates micro-batches inside "
            "each optimizer step; set gradient_accumulation_steps=1 and use hf3d.ParallelConfig(num_microbatches=...) "
            "(per_device_train_batch_size is the rows of one dp replica per step)"
        )
    m = pmodel.pcfg.num_microbatches
    if args.per_device_train_batch_size % m:
        raise ValueError(
            f"per_device_train_batch_size={args.per_device_train_batch_size} (rows per dp replica) is not a multiple "
            f"of num_microbatches={m}"
        )
    world = dist.get_world_size()
    if args.world_size != world:
        raise ValueError(
            f"the TrainingArguments see {args.world_size} process(es) but {world} were launched; on CPU pass "
            "TrainingArguments(use_cpu=True) (accelerate reports a single process on CPU otherwise)"
        )
    if args.fp16:
        raise ValueError("TrainingArguments(fp16=True) is not supported by hf3d; use bf16 or fp32")
    if args.bf16 and pmodel.param_dtype != torch.bfloat16:
        raise ValueError(
            "TrainingArguments(bf16=True) with an fp32 hf3d model: hf3d does not autocast; parallelize with "
            "dtype=torch.bfloat16 instead (fp32 master weights and gradients are kept)"
        )
    if args.push_to_hub and args.hub_token:
        # stock's checkpoint push saves these very args (token included) into the folder it uploads
        raise ValueError(
            "TrainingArguments(push_to_hub=True, hub_token=...): the Trainer's checkpoint push would upload the token "
            "inside training_args.bin; leave hub_token unset and log in with `hf auth login` or set HF_TOKEN"
        )
    unsupported = {
        "label_smoothing_factor": args.label_smoothing_factor != 0,  # hf3d computes the loss inside its schedule
        "load_best_model_at_end": args.load_best_model_at_end,
        "train_sampling_strategy='batch_rebalance'": args.train_sampling_strategy == "batch_rebalance",
        "activation_checkpointing": bool(args.activation_checkpointing),
        "neftune_noise_alpha": args.neftune_noise_alpha is not None,
        "use_liger_kernel": args.use_liger_kernel,
    }
    named = [k for k, on in unsupported.items() if on]
    if named:
        raise ValueError(f"hf3d.Trainer does not support {', '.join(named)} yet")


def without_fsdp(args: TrainingArguments, pmodel: ParallelModel) -> TrainingArguments:
    """`fsdp` / `fsdp_config` map onto hf3d's zero stage (hf3d/parallel/sharding.py): the model must have been built
    with what they ask for (`hf3d.ParallelConfig.from_env(training_args=args)`). The stock Trainer then gets a copy
    without them, so that it wraps nothing in accelerate's FSDP: hf3d shards the model itself."""
    wanted = training_args_settings(args)
    if not wanted:
        return args
    check_request(pmodel, wanted, "TrainingArguments(fsdp=..., fsdp_config=...)")
    plain = copy.copy(args)
    plain.fsdp, plain.fsdp_config, plain.fsdp_plugin_args = None, None, None
    return plain


def without_secrets(args: TrainingArguments) -> TrainingArguments:
    """A copy of args to save beside an export, whose `*_token` fields (hub_token) are None: the fields stock's
    own `to_dict` masks. training_args.bin travels with every export and checkpoint, and may be pushed."""
    clean = copy.copy(args)
    for f in dataclasses.fields(args):
        if f.name.endswith("_token"):
            setattr(clean, f.name, None)
    return clean


def _in_lockstep(dataloader, pm):
    """(batch, counted) of the dataloader's batches; when a forward is collective over dp (`pm.lockstep`: ZeRO-3,
    expert parallelism) every replica runs as many forwards, a replica out of batches running its last batch again
    (or a row of token 0), not counted, until none has batches left (one small all-reduce per batch)."""
    if not (pm.lockstep and pm.dp_size > 1):
        for inputs in dataloader:
            yield inputs, True
        return
    batches, last = iter(dataloader), None
    while True:
        inputs = next(batches, None)
        more = torch.tensor([0 if inputs is None else 1], device=pm.device)
        dist.all_reduce(more, op=dist.ReduceOp.MAX, group=pm.mesh.get_group("dp"))
        if not more.item():
            return
        if inputs is not None:
            last = inputs
            yield inputs, True
            continue
        ids = last["input_ids"] if last is not None else torch.zeros(1, 2 * pm.pcfg.cp * pm.pcfg.tp, dtype=torch.long)
        yield {"input_ids": ids, "labels": ids}, False


class _EveryNth:
    """Batches start, start + step, ... of a DataLoader: one dp replica's share of an eval set, without the
    padding accelerate's shards add (a repeated row would count twice in the token mean)."""

    def __init__(self, dataloader: DataLoader, start: int, step: int):
        self.dataloader, self.start, self.step = dataloader, start, step
        self.dataset = dataloader.dataset

    def __iter__(self):
        return islice(iter(self.dataloader), self.start, None, self.step)

    def __len__(self) -> int:
        return max(0, -(-(len(self.dataloader) - self.start) // self.step))


class Trainer(HFTrainer):
    """A `transformers.Trainer` for the model `hf3d.parallelize` returns; launch every rank with the same script.

    `per_device_train_batch_size` / `per_device_eval_batch_size` are rows per dp replica; gradient
    accumulation is hf3d's `ParallelConfig(num_microbatches=...)`. `optimizers=(opt, sched)` takes an
    optimizer from `hf3d.build_optimizer`. `compute_loss_func`, `compute_metrics` and label smoothing are
    refused: the loss is computed inside hf3d's pipeline schedule."""

    def __init__(
        self,
        model: ParallelModel | None = None,
        args: TrainingArguments | None = None,
        *rest,
        eval_tasks: list[str] | TaskEvalConfig | None = None,
        **kwargs,
    ):
        """eval_tasks: downstream multiple-choice tasks (names or JSONL files, or a TaskEvalConfig with the
        limit, few-shot, ... options) that every `evaluate()` also scores at the model's mesh, reported as
        `eval_downstream/<task>/<acc|acc_norm|acc_norm_token|bpb>` (and `.../average/...`); with them,
        evaluate() needs no eval_dataset."""
        if not isinstance(model, ParallelModel):
            raise TypeError(
                f"hf3d.Trainer trains the model hf3d.parallelize returns (no model_init), got {type(model).__name__}"
            )
        if args is None:
            args = TrainingArguments(output_dir="tmp_trainer", use_cpu=not torch.cuda.is_available())
        check_training_args(args, model)
        args = without_fsdp(args, model)
        model._is_accelerate_prepared = True  # accelerate must not wrap it in DDP (DESIGN decision 10)
        super().__init__(model, args, *rest, **kwargs)
        check_accelerator(self.accelerator, model)
        if self.compute_loss_func is not None or self.compute_metrics is not None:
            raise ValueError(
                "hf3d.Trainer takes no compute_loss_func or compute_metrics: the loss is computed inside hf3d's "
                "schedule, and evaluate() reports eval_loss and eval_perplexity"
            )
        # the loss is already the exact global token mean; stock's num_items_in_batch path would rescale it
        self.model_accepts_loss_kwargs = False
        if eval_tasks is not None and not isinstance(eval_tasks, TaskEvalConfig):
            eval_tasks = TaskEvalConfig(tasks=list(eval_tasks))
        self.eval_tasks = eval_tasks
        self._tasks = load_tasks(eval_tasks) if eval_tasks is not None else None  # checked now, before training
        self._evaluator = None

    # -- data ---------------------------------------------------------------------------------------
    def _get_dataloader(
        self, dataset, description, batch_size, sampler_fn=None, is_training=False, dataloader_key=None
    ) -> DataLoader:
        """Stock's DataLoader (collator, unused columns removed, sampler), sharded over dp only: every tp/pp peer
        of a replica reads the same rows, and dp rank d takes the d-th of every dp consecutive batches."""
        from accelerate.data_loader import prepare_data_loader

        args, pm = self.args, self.model
        collator = self.data_collator
        if _is_hf_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(collator, description=description)
        params = {
            "batch_size": batch_size,
            "collate_fn": collator,
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
            "persistent_workers": args.dataloader_persistent_workers,
            "multiprocessing_context": args.dataloader_multiprocessing_context,
            "prefetch_factor": args.dataloader_prefetch_factor,
            "in_order": args.dataloader_in_order,
        }
        if not isinstance(dataset, IterableDataset):
            params["sampler"] = sampler_fn(dataset) if sampler_fn is not None else None
            params["drop_last"] = args.dataloader_drop_last
        loader = DataLoader(dataset, **params)
        if not is_training:
            return _EveryNth(loader, pm.dp_rank, pm.dp_size)
        acc = self.accelerator
        shard = prepare_data_loader(  # as accelerator.prepare would, over dp instead of every process
            loader,
            acc.device,
            num_processes=pm.dp_size,
            process_index=pm.dp_rank,
            split_batches=acc.split_batches,
            put_on_device=True,
            rng_types=acc.rng_types.copy(),
            dispatch_batches=False,  # dispatching splits each batch over every process
            even_batches=acc.even_batches,
            use_seedable_sampler=acc.use_seedable_sampler,
            data_seed=acc.dataloader_config.data_seed,
            non_blocking=acc.non_blocking,
            use_stateful_dataloader=acc.use_stateful_dataloader,
        )
        shard._is_accelerate_prepared = True
        return shard

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        # rows per optimizer step: one replica's rows times dp (stock counts every process as a replica)
        return self._train_batch_size * args.gradient_accumulation_steps * self.model.dp_size

    def _track_num_input_tokens(self, inputs) -> None:
        # stock sums over every process, which counts each replica's rows once per tp/pp peer
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        peers = dist.get_world_size() // self.model.dp_size
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // peers

    # -- optimizer and step ---------------------------------------------------------------------------
    def create_optimizer(self, model=None) -> ParallelOptimizer:
        """hf3d.build_optimizer with the class and arguments stock picks from the TrainingArguments, stock's
        weight-decay rule (`get_decay_parameter_names`: none for biases and norms) and max_grad_norm, which
        hf3d applies to the global norm over tp x pp x dp."""
        if self.optimizer is None:
            if self.optimizer_cls_and_kwargs is not None:
                optimizer_cls, kwargs = self.optimizer_cls_and_kwargs
            else:
                optimizer_cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)
            taken = sorted({"params", "model", "optimizer_dict"} & set(kwargs))
            if taken:
                raise ValueError(f"optim={self.args.optim!r} builds its own parameter groups ({taken}); hf3d cannot")
            # names as ParallelOptimizer sees them; the Trainer's own method, so that a subclass overriding it is
            # obeyed. Its default is hf3d's (build_optimizer(exclude_from_weight_decay=True), hf3d train's default)
            decay = set(self.get_decay_parameter_names(self.model.hf_model))
            self.optimizer = build_optimizer(
                self.model,
                optimizer_cls,
                max_grad_norm=self.args.max_grad_norm if self.args.max_grad_norm > 0 else None,
                weight_decay=self.args.weight_decay,
                exclude_from_weight_decay=lambda name, _param: name not in decay,
                **kwargs,
            )
        elif not isinstance(self.optimizer, ParallelOptimizer):
            raise TypeError(
                f"optimizers=({type(self.optimizer).__name__}, ...): pass an optimizer from hf3d.build_optimizer"
            )
        self.optimizer._is_accelerate_prepared = True
        return self.optimizer

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        # the Trainer calls model.zero_grad(), never optimizer.zero_grad(), and hf3d's gradients live in the optimizer
        self.optimizer.zero_grad()
        return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model):
        # hf3d clips inside optimizer.step() with the global norm; accelerate's clip would rescale stray p.grad
        return None

    def _get_grad_norm(self, model, grad_norm=None):
        # the norm is known only after optimizer.step(): see _maybe_log_save_evaluate
        return grad_norm

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *rest, **kwargs) -> None:
        # log the pre-clip global grad norm hf3d's optimizer.step() measured (stock's, from p.grad, is 0)
        norm = getattr(self.optimizer, "last_grad_norm", None)
        super()._maybe_log_save_evaluate(tr_loss, grad_norm if norm is None else norm, *rest, **kwargs)

    # -- evaluation -----------------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Stock's evaluate; with eval_tasks and no eval dataset, the downstream scores alone (logged, and
        passed to the callbacks' on_evaluate, as stock does with its metrics)."""
        if eval_dataset is None and self.eval_dataset is None and self.eval_tasks is not None:
            metrics = self._task_metrics(metric_key_prefix)
            self.log(metrics)
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
            return metrics
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def _task_metrics(self, prefix: str) -> dict[str, float]:
        """The eval_tasks' scores at the model's mesh (collective), `{prefix}_downstream/<task>/<metric>`."""
        if self.eval_tasks is None:
            return {}
        if self._evaluator is None:  # tokenised and packed once, at the first evaluation
            tokenizer = self.processing_class
            if tokenizer is None:
                from ..utils.tokens import load_tokenizer

                if self.model.tokenizer_dir is None:
                    raise ValueError("eval_tasks needs a tokenizer: pass processing_class=tokenizer to hf3d.Trainer")
                tokenizer = load_tokenizer(self.model.tokenizer_dir)
            self._evaluator = Evaluator(self.model, self._tasks, tokenizer, self.eval_tasks)
        return self._evaluator.run(progress=False).metrics(prefix=f"{prefix}_downstream")

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ) -> EvalLoopOutput:
        """`{prefix}_loss`: the token mean over the whole set (sum of token losses / label tokens, summed over dp;
        stock averages per-batch means, the same when one batch holds the set), and `{prefix}_perplexity`. Each
        replica evaluates its own batches; predictions are not gathered."""
        pm = self.model
        pm.eval()
        self.callback_handler.eval_dataloader = dataloader
        totals = torch.zeros(3, dtype=torch.float64, device=pm.device)  # [token loss sum, label tokens, rows]
        for inputs, counted in _in_lockstep(dataloader, pm):
            inputs = self._prepare_inputs(inputs)
            labels = inputs.pop("labels", None)
            if labels is None:
                raise ValueError(f"{description} needs labels in every batch: hf3d.Trainer reports the loss")
            with torch.no_grad():
                logits = pm(**inputs).logits
            if not counted:  # a forward for the replicas that still have batches (ZeRO-3, ep > 1)
                continue
            targets = labels[:, 1:].to(logits.device).flatten()
            loss_sum = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum"
            )
            num_tokens = (targets != IGNORE_INDEX).sum()
            totals += torch.stack([loss_sum.double(), num_tokens.double(), totals.new_tensor(len(labels))])
            self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
        if pm.dp_size > 1:
            dist.all_reduce(totals, group=pm.mesh.get_group("dp"))
        loss_sum, num_tokens, num_rows = totals.tolist()
        loss = loss_sum / num_tokens if num_tokens else float("nan")
        metrics = {
            f"{metric_key_prefix}_loss": loss,
            f"{metric_key_prefix}_perplexity": math.exp(loss) if loss < 700 else float("inf"),
            **self._task_metrics(metric_key_prefix),
        }
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=int(num_rows))

    # -- saving and resuming --------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Collective HF export (every rank sends its pieces; stock writes rank 0's model alone), added to what
        output_dir already holds, as stock does."""
        out = Path(output_dir if output_dir is not None else self.args.output_dir)
        staging = out / EXPORT_STAGING
        self.model.save_pretrained(staging)
        if self.args.should_save:
            for stale in out.iterdir():  # the weights of an earlier save here, which stock's save_pretrained drops
                if is_weights_file(stale.name):
                    files.remove_file(stale)
            for f in staging.iterdir():
                if f.name != files.OWNER_FILE:  # the Trainer's folder stays the user's
                    files.move_file(f, out / f.name)
            files.remove_dir(staging, EXPORT)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(out)
            files.write_file(out / TRAINING_ARGS_NAME, _saved(without_secrets(self.args)), replace=True)
        dist.barrier()  # the folder is complete when save_model returns on any rank

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # every rank writes its shard of weights and optimizer state, readable at any mesh (stock: rank 0's only)
        save_checkpoint(Path(output_dir) / CHECKPOINT_SUBDIR, self.model, self.optimizer, step=self.state.global_step)
        if self.args.should_save:
            files.write_file(Path(output_dir) / SCHEDULER_NAME, _saved(self.lr_scheduler.state_dict()), replace=True)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # the weights come back with the optimizer state, in _load_optimizer_and_scheduler (one sharded read)
        if not is_complete(Path(resume_from_checkpoint) / CHECKPOINT_SUBDIR):
            raise ValueError(
                f"{resume_from_checkpoint} holds no complete hf3d checkpoint ({CHECKPOINT_SUBDIR}/): resume from a "
                "checkpoint hf3d.Trainer saved with save_only_model=False"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # model and optimizer from hf3d's sharded checkpoint, at this mesh; the scheduler from stock's file
        if checkpoint is None:
            return
        load_checkpoint(Path(checkpoint) / CHECKPOINT_SUBDIR, self.model, self.optimizer)
        self.lr_scheduler.load_state_dict(load_small(checkpoint, SCHEDULER_NAME))  # an archive checked first


def _saved(obj) -> bytes:
    """What torch.save writes of `obj`."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _is_hf_dataset(dataset) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)
