"""YAML values -> the config dataclasses, checked against each field's type hint.

Every config section is a small dataclass; `build_section` fills one from a dict and refuses what
it cannot take with one line naming the key, where it is, and what to write instead: an unknown key
gets the nearest known name, a value of the wrong type names the type expected. Nested dataclasses
and lists of them (data.stages[i].sources[j]) are built the same way, with their path in the message.
"""

from __future__ import annotations

import dataclasses
import difflib
import keyword
import types
import typing
from typing import Any, Union

_NONE = type(None)

OTHER_NAMES = {
    **dict.fromkeys(("learning_rate", "max_lr"), "optim.lr"),
    **dict.fromkeys(("min_learning_rate", "lr_min"), "optim.min_lr"),
    **dict.fromkeys(("lr_warmup_steps", "lr_warmup_iters", "num_warmup_steps"), "optim.warmup_steps"),
    **dict.fromkeys(("lr_scheduler_type", "lr_decay_style", "lr_scheduler"), "optim.schedule"),
    **dict.fromkeys(("clip_grad", "gradient_clipping", "grad_clip"), "optim.max_grad_norm"),
    **dict.fromkeys(("max_steps", "train_iters", "train_steps", "total_steps"), "run.steps"),
    **dict.fromkeys(("global_batch_size", "train_batch_size"), "run.global_batch"),
    **dict.fromkeys(("logging_steps", "log_interval", "iteration_step_info_interval"), "run.log_every"),
    **dict.fromkeys(("save_steps", "save_interval", "checkpoint_interval"), "checkpoint.every"),
    **dict.fromkeys(("save_total_limit",), "checkpoint.keep_last"),
    **dict.fromkeys(("resume_from_checkpoint", "resume_checkpoint_path", "load"), "checkpoint.resume"),
    **dict.fromkeys(("seq_length", "sequence_length", "max_seq_length", "block_size"), "data.seq_len"),
    **dict.fromkeys(("tensor_model_parallel_size", "tp_size", "tensor_parallel_size"), "parallel.tp"),
    **dict.fromkeys(("pipeline_model_parallel_size", "pp_size", "pipeline_parallel_size"), "parallel.pp"),
    **dict.fromkeys(("data_parallel_size", "dp_size"), "parallel.dp"),
    **dict.fromkeys(("context_parallel_size", "cp_size"), "parallel.cp"),
    **dict.fromkeys(("expert_model_parallel_size", "ep_size", "expert_parallel_size"), "parallel.ep"),
    **dict.fromkeys(("gradient_accumulation_steps", "batch_accumulation_per_replica"), "parallel.num_microbatches"),
    **dict.fromkeys(("gradient_checkpointing", "recompute_granularity"), "parallel.recompute"),
    **dict.fromkeys(("cpu_offloading_activations",), "parallel.activation_offload"),
    **dict.fromkeys(("model_name_or_path", "pretrained_model_name_or_path", "init_checkpoint"), "model.path"),
    **dict.fromkeys(("torch_dtype",), "model.dtype"),
}
"""Names other trainers give a setting (the transformers Trainer, accelerate, nanotron, Megatron) -> hf3d's key
as section.key: an unknown key named here is answered with it."""


def other_name_hint(key: str, where: str) -> str:
    """`did you mean ...? ` for a key another trainer uses (`OTHER_NAMES`), naming hf3d's key (its section too when
    `where` is another section), or ""."""
    target = OTHER_NAMES.get(str(key).lower())
    if target is None:
        return ""
    section, name = target.split(".")
    return f"did you mean {name!r}? " if where == section else f"did you mean {target}? "


def build_section(cls, values: dict | None, where: str):
    """An instance of dataclass `cls` from `values` (a YAML mapping); `where` names it in messages."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ValueError(f"{where} must be a mapping of key: value, got {_describe(values)}")
    fields = {key_of(f.name): f for f in dataclasses.fields(cls) if f.init}
    for key in values:
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = other_name_hint(key, where) or (f"did you mean {near[0]!r}? " if near else "")
            raise ValueError(f"unknown key {key!r} in {where}; {hint}known keys: {', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {
        fields[key].name: coerce(value, hints[fields[key].name], f"{where}.{key}") for key, value in values.items()
    }
    try:
        return cls(**kwargs)
    except ValueError as e:  # the class's own checks name `Class.key` for Python callers; a file names `where.key`
        raise ValueError(str(e).replace(f"{cls.__name__}.", f"{where}.")) from None


def set_value(item: str, value: str):
    """The value of one `--set KEY=VALUE` as YAML reads it (safe_load: plain values, lists, mappings), or one line
    naming the item when it is not YAML hf3d reads (a python tag, a broken quote)."""
    import yaml

    try:
        return yaml.safe_load(value)
    except yaml.YAMLError as e:
        detail = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ValueError(f"--set {item!r}: the value is not YAML hf3d reads ({detail}); write a plain value") from None


def key_of(field_name: str) -> str:
    """The YAML key of a dataclass field: a Python keyword is spelled with a trailing underscore in the
    code (checkpoint.async is the field `async_`)."""
    stem = field_name.removesuffix("_")
    return stem if stem != field_name and keyword.iskeyword(stem) else field_name


def coerce(value: Any, hint, where: str):
    """`value` as type `hint`, or a ValueError naming `where`. Numbers written as strings (YAML reads
    `3e-4` without a dot as a string) are taken as numbers; an int is taken where a float is expected."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and _NONE in options:
            return None
        errors = []
        for option in options:
            if option is _NONE:
                continue
            try:
                return coerce(value, option, where)
            except ValueError as e:
                if dataclasses.is_dataclass(option) and isinstance(value, dict):
                    raise  # a section given as a mapping: its own key's message, not "must be a mapping"
                errors.append(e)
        raise ValueError(f"{where} must be {_type_name(hint)}, got {_describe(value)}")
    if dataclasses.is_dataclass(hint):
        return build_section(hint, value, where)
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ValueError(
                f"{where} must be a list of {_type_name(typing.get_args(hint)[0])}, got {_describe(value)}"
            )
        args = typing.get_args(hint)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ValueError(f"{where} must be a list of {len(args)} values, got {len(value)}")
            return tuple(coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a mapping, got {_describe(value)}")
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{where} must be true or false, got {_describe(value)}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError(f"{where} must be an integer, got {_describe(value)}")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"{where} must be a number, got {_describe(value)}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{where} must be a string, got {_describe(value)}")
    return value


def _type_name(hint) -> str:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        names = [_type_name(a) for a in typing.get_args(hint) if a is not _NONE]
        none = _NONE in typing.get_args(hint)
        return " or ".join(names) + (" (or null)" if none else "")
    if origin in (list, tuple):
        return "a list"
    if dataclasses.is_dataclass(hint):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a mapping"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )


def _describe(value) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"
