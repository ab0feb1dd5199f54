"""The run configuration: YAML + dotlist overrides -> checked dataclasses, before anything heavy starts.

Errors name the bad key (with the closest valid key), the wrong type, or the missing value. Free variables live
under ``variables:`` and are used through omegaconf interpolation (``${variables.data_root}``). ``${oc.env:NAME}``
takes the environment's value for the run; the config as saved and logged shows the expression (``config_env``).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml
from composer.core import Time
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from streaming.base.hashing import get_hashes

from dha_train import families
from dha_train.config_env import env_values, show_env_values
from dha_train.data.domains import DOMAINS
from dha_train.errors import DhaTrainError


class ConfigError(DhaTrainError, ValueError):
    """A configuration problem, with the offending key path in the message."""


REQUIRED = '???'  # omegaconf's marker for a value that must be given


@dataclass
class ModelConfig:
    # A local HF folder to start from (a real checkpoint); when null the model is built from `config`.
    pretrained_path: Optional[str] = None
    # Config fields of the model's family (hidden_size, num_hidden_layers, ...); applied on top of the pretrained
    # config when both are given. Without a pretrained folder, `model_type` names the family (default llama: a
    # LlamaConfig). Keys are checked against that family's config class (dha_train.families).
    config: dict[str, Any] = field(default_factory=dict)
    # Local HF tokenizer folder; defaults to pretrained_path. Saved into checkpoints and exports.
    tokenizer: Optional[str] = None
    # 'sdpa' (default), 'eager', or 'flash_attention_2' (needs the optional `gpu` extra).
    attn_implementation: str = 'sdpa'
    activation_checkpointing: bool = False
    # Under FSDP with more than one process, only global rank 0 reads the pretrained weights (or draws the initial
    # ones); the other ranks build the model on the meta device, without memory, and Composer's FSDP2 broadcasts
    # rank 0's weights into every rank's shards. Host memory then holds one full fp32 copy (on rank 0) instead of
    # one per process (27 GB each for a 7B). A distillation teacher follows the same path. false: every rank loads
    # the whole model, as before (kept for comparison: `dha-train bench load`).
    load_on_rank0: bool = True


@dataclass
class StreamConfig:
    # Where this domain's MDS split lives; defaults to <loader.root>/<domain>/<split>.
    local: Optional[str] = None
    # Remote location (s3://, gs://, oci://, ...) streamed into `local`; defaults to <loader.remote>/<domain>/<split>.
    remote: Optional[str] = None
    # Relative sampling weight; null takes the RedPajama proportion of the domain. Renormalised over the streams.
    proportion: Optional[float] = None


@dataclass
class TrainLoaderConfig:
    root: str = REQUIRED  # local folder holding <domain>/<split>/ MDS folders (the output of `dha-train data prep`)
    remote: Optional[str] = None
    split: str = 'train'
    # One entry per domain. Null: every domain found under root, with the RedPajama proportions.
    streams: Optional[dict[str, StreamConfig]] = None
    # Samples per epoch over all ranks, drawn from the streams by proportion (streaming's epoch_size); null: the
    # streams' total sample count. Resume is exact within and across epochs.
    epoch_size: Optional[int] = None
    shuffle: bool = True
    shuffle_algo: str = 'py1e'
    shuffle_block_size: Optional[int] = None
    num_canonical_nodes: Optional[int] = None
    predownload: Optional[int] = None
    cache_limit: Optional[str] = None
    download_timeout: float = 60.0
    num_workers: int = 0
    prefetch_factor: Optional[int] = None
    persistent_workers: bool = False
    drop_last: bool = True
    # Shard integrity. Splits read in place (no remote) are checked before training: every shard file's size, and
    # its hash as index.json records it. 'auto': the hash data prep records (xxh64), sizes only for data recorded
    # without hashes; an algorithm name (xxh64, sha1, ...): every shard must record that one; null: no check. The
    # ranks of a node share the hashing; xxh64 runs at ~11 GB/s per core, so reading the files bounds it. A
    # remote's shards are checked by streaming as it downloads them, and only when an algorithm is named.
    validate_hash: Optional[str] = 'auto'


@dataclass
class EvalLoaderConfig:
    root: str = REQUIRED
    remote: Optional[str] = None
    split: str = 'val'
    # Domains to evaluate, each reported as its own loss; null: every domain with a split under root.
    domains: Optional[list[str]] = None
    num_workers: int = 0
    # Batches per domain per evaluation; -1 means the whole split.
    subset_num_batches: int = -1
    # Shard integrity, as train_loader.validate_hash.
    validate_hash: Optional[str] = 'auto'


# Composer's DecoupledAdamW decays by weight_decay (times the lr schedule's factor) per step: 1e-3 already halves an
# unused weight in 700 steps. Larger values are almost always AdamW values (scaled by the lr there) copied over.
MAX_DECOUPLED_WEIGHT_DECAY = 1.0e-3


@dataclass
class OptimizerConfig:
    name: str = 'decoupled_adamw'
    lr: float = 1.0e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1.0e-8
    weight_decay: float = 0.0
    # Parameters whose name contains one of these substrings go to the `no_decay` group.
    no_decay_name_patterns: list[str] = field(default_factory=lambda: ['bias', 'norm'])


@dataclass
class SchedulerConfig:
    name: str = 'cosine_with_warmup'
    t_warmup: str = '100ba'
    alpha_f: float = 0.1  # final lr as a fraction of the peak (cosine "to 10%")


@dataclass
class FSDPConfig:
    enabled: bool = True
    reshard_after_forward: bool = True
    state_dict_type: str = 'sharded'  # 'sharded' (one file per rank) or 'full'
    mixed_precision: str = 'DEFAULT'
    activation_cpu_offload: bool = False


@dataclass
class TrainConfig:
    variables: dict[str, Any] = field(default_factory=dict)
    run_name: Optional[str] = None
    seed: int = 17
    model: ModelConfig = field(default_factory=ModelConfig)
    train_loader: TrainLoaderConfig = field(default_factory=TrainLoaderConfig)
    eval_loader: Optional[EvalLoaderConfig] = None
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_duration: str = REQUIRED  # Composer time string: '800ba', '1ep', '200000000tok'
    global_train_batch_size: int = REQUIRED
    device_train_microbatch_size: int = REQUIRED
    device_eval_batch_size: int = 8
    eval_interval: str = '500ba'
    eval_first: bool = False
    precision: str = 'auto'  # 'auto': fp32 on CPU, amp_bf16 on GPU
    device: str = 'auto'  # 'auto', 'cpu' or 'gpu'
    fsdp: Optional[FSDPConfig] = None
    save_folder: Optional[str] = None
    save_interval: str = '1000ba'
    save_num_checkpoints_to_keep: int = -1
    save_overwrite: bool = False
    autoresume: bool = False
    load_path: Optional[str] = None
    load_weights_only: bool = False
    # name -> kwargs, built through dha_train.registry
    loggers: dict[str, dict[str, Any]] = field(default_factory=dict)
    callbacks: dict[str, dict[str, Any]] = field(default_factory=dict)
    algorithms: dict[str, dict[str, Any]] = field(default_factory=dict)
    console_log_interval: str = '10ba'
    progress_bar: bool = False
    dist_timeout: float = 600.0


def _type_name(tp: Any) -> str:
    return getattr(tp, '__name__', None) or str(tp).replace('typing.', '')


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and build dataclasses; raise ConfigError naming ``path``."""
    tp, optional = _unwrap_optional(tp)
    if value is None:
        if optional or tp is Any:
            return None
        raise ConfigError(f'{path}: must be a {_type_name(tp)}, got null')
    if value == REQUIRED:
        raise ConfigError(f'{path}: missing required value')
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f'{path}: must be a mapping of {tp.__name__} fields, got {type(value).__name__} {value!r}')
        return _build_dataclass(tp, value, path)
    origin = typing.get_origin(tp)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f'{path}: must be a mapping, got {type(value).__name__} {value!r}')
        _, value_tp = typing.get_args(tp)
        return {str(k): _convert(v, value_tp, f'{path}.{k}') for k, v in value.items()}
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f'{path}: must be a list, got {type(value).__name__} {value!r}')
        (item_tp,) = typing.get_args(tp)
        return [_convert(v, item_tp, f'{path}[{i}]') for i, v in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # '800' style durations and names written without quotes
    if tp in (int, float, bool) and (not isinstance(value, tp) or (tp is int and isinstance(value, bool))):
        raise ConfigError(f'{path}: must be {_type_name(tp)}, got {type(value).__name__} {value!r}')
    if tp is str and not isinstance(value, str):
        raise ConfigError(f'{path}: must be str, got {type(value).__name__} {value!r}')
    return value


def unknown_key_error(path: str, key: str, valid: typing.Iterable[str]) -> ConfigError:
    valid = sorted(valid)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ''
    where = f'{path}.{key}' if path else key
    return ConfigError(f"unknown config key '{where}'{hint} (valid keys here: {', '.join(valid)})")


def check_model_config_keys(overrides: dict, model_type: str | None = None) -> None:
    """Every key of ``model.config`` must be a field of the model's family config (``model_type``: the family of
    ``model.config.model_type``, LLaMA by default; None before the pretrained folder is read: a field of any
    family). ``model.config.model_type`` itself must name a family."""
    chosen = overrides.get('model_type')
    if chosen is not None:
        families.get(chosen, 'model.config.model_type')
        model_type = chosen
    names = [model_type] if model_type is not None else list(families.FAMILIES)
    valid = {key for name in names for key in families.get(name).config_class().to_dict()} | {'model_type'}
    for key in overrides:
        if key not in valid:
            raise unknown_key_error('model.config', key, valid)


def _build_dataclass(cls: type, values: dict, path: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in names:
            raise unknown_key_error(path, str(key), names)
    kwargs = {}
    for f in dataclasses.fields(cls):
        where = f'{path}.{f.name}' if path else f.name
        if f.name in values:
            kwargs[f.name] = _convert(values[f.name], hints[f.name], where)
        elif f.default is REQUIRED:
            raise ConfigError(f'{where}: missing required value')
    return cls(**kwargs)


def _load_yaml(path: Path):
    """``OmegaConf.load`` with a YAML syntax error or a non-UTF-8 byte as one ConfigError naming file, line, column."""
    try:
        return OmegaConf.load(path)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f' at line {mark.line + 1}, column {mark.column + 1}' if mark is not None else ''
        context = f' ({exc.context})' if exc.context else ''
        raise ConfigError(f'{path}: not valid YAML: {exc.problem}{at}{context}') from None
    except yaml.YAMLError as exc:
        raise ConfigError(f'{path}: not valid YAML: {" ".join(str(exc).split())}') from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f'{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x}: {exc.reason})') from None


def load_config(source: str | Path | dict, overrides: typing.Sequence[str] = ()) -> TrainConfig:
    """Read a YAML file (or a dict), apply ``key=value`` overrides, resolve interpolations and check everything."""
    if isinstance(source, dict):
        cfg = OmegaConf.create(source)
    else:
        source = Path(source)
        if not source.is_file():
            raise ConfigError(f'config file not found: {source}')
        cfg = _load_yaml(source)
    bad = [o for o in overrides if '=' not in o]
    if bad:
        raise ConfigError(f'overrides must look like key=value, got: {bad}')
    try:
        if overrides:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
        raw = OmegaConf.to_container(cfg, resolve=True)
        unresolved = OmegaConf.to_container(cfg, resolve=False)
    except OmegaConfBaseException as exc:
        raise ConfigError(f'cannot resolve config: {exc}') from exc
    if not isinstance(raw, dict):
        raise ConfigError('the config must be a mapping at the top level')
    config = _build_dataclass(TrainConfig, raw, '')
    _check_values(config)
    config.env_values = env_values(raw, unresolved)  # not a field: no recipe sets it
    return config


# Algorithms that each set the LM loss's weight (their ``lm_weight``: the loss becomes ``lm_weight * L_lm + ...``).
# Two in one run would each cancel the LM term, giving it a weight of -1 (training would push the LM loss up).
LM_WEIGHT_OWNERS = ('attention_transfer', 'distillation')


def _check_values(config: TrainConfig) -> None:
    """Cross-field checks that the types alone cannot express."""
    owners = [name for name in config.algorithms if name in LM_WEIGHT_OWNERS]
    if len(owners) > 1:
        raise ConfigError(f"algorithms: {' and '.join(owners)} each set the LM loss's weight (lm_weight), so together "
                          'they would weight it -1 and train it upwards; run them as separate stages (transfer, then '
                          'distillation, as launch/heal.sh does)')
    for name in ('max_duration', 'eval_interval', 'save_interval', 'console_log_interval'):
        value = getattr(config, name)
        try:
            Time.from_timestring(value)
        except ValueError as exc:
            raise ConfigError(f"{name}: '{value}' is not a Composer time string such as '800ba', '1ep', '1000tok'") from exc
    try:
        Time.from_timestring(config.scheduler.t_warmup)
    except ValueError as exc:
        raise ConfigError(f"scheduler.t_warmup: '{config.scheduler.t_warmup}' is not a Composer time string") from exc
    check_model_config_keys(config.model.config,
                            None if config.model.pretrained_path is not None else 'llama')
    for domain in config.train_loader.streams or {}:
        if domain not in DOMAINS:
            raise unknown_key_error('train_loader.streams', domain, DOMAINS)
    if config.eval_loader is not None:
        for domain in config.eval_loader.domains or []:
            if domain not in DOMAINS:
                raise ConfigError(f"eval_loader.domains: unknown domain '{domain}' (valid: {', '.join(DOMAINS)})")
    for where, loader in (('train_loader', config.train_loader), ('eval_loader', config.eval_loader)):
        if loader is not None and loader.validate_hash not in (None, 'auto', *get_hashes()):
            raise ConfigError(f"{where}.validate_hash: '{loader.validate_hash}' is neither auto, null nor a hash "
                              f"streaming knows ({', '.join(sorted(get_hashes()))})")
    for stream_domain, stream in (config.train_loader.streams or {}).items():
        if stream.proportion is not None and stream.proportion <= 0:
            raise ConfigError(f'train_loader.streams.{stream_domain}.proportion must be > 0, got {stream.proportion}')
    if config.train_loader.epoch_size is not None and config.train_loader.epoch_size < config.global_train_batch_size:
        raise ConfigError(f'train_loader.epoch_size={config.train_loader.epoch_size} samples is less than one global '
                          f'batch ({config.global_train_batch_size})')
    if config.global_train_batch_size <= 0 or config.device_train_microbatch_size <= 0:
        raise ConfigError('global_train_batch_size and device_train_microbatch_size must be positive')
    if config.autoresume and (config.save_folder is None or config.run_name is None):
        raise ConfigError('autoresume needs both save_folder and run_name')
    if config.precision not in ('auto', 'fp32', 'amp_bf16', 'amp_fp16'):
        raise ConfigError(f"precision: '{config.precision}' is not one of auto, fp32, amp_bf16, amp_fp16")
    if config.device not in ('auto', 'cpu', 'gpu'):
        raise ConfigError(f"device: '{config.device}' is not one of auto, cpu, gpu")
    if config.model.attn_implementation not in ('sdpa', 'eager', 'flash_attention_2'):
        raise ConfigError(
            f"model.attn_implementation: '{config.model.attn_implementation}' is not one of sdpa, eager, "
            'flash_attention_2')
    if config.fsdp is not None and config.fsdp.state_dict_type not in ('sharded', 'full'):
        raise ConfigError(f"fsdp.state_dict_type: '{config.fsdp.state_dict_type}' is not 'sharded' or 'full'")
    if not 0.0 <= config.optimizer.weight_decay <= MAX_DECOUPLED_WEIGHT_DECAY:
        # Papers quote torch AdamW's weight decay, which AdamW scales by the lr; Composer's DecoupledAdamW does not.
        wd, lr = config.optimizer.weight_decay, config.optimizer.lr
        raise ConfigError(
            f'optimizer.weight_decay={wd}: decoupled_adamw shrinks every weight by weight_decay x (lr / peak lr) '
            f'each step ({wd:.0%} per step at the peak here), so it must be in [0, {MAX_DECOUPLED_WEIGHT_DECAY}]. '
            f'For torch AdamW\'s weight decay {wd} at lr {lr:g}, use {wd * lr:g}')


def per_device_batch(config: TrainConfig, world_size: int, ranks: str) -> int:
    """The per-rank batch of ``config`` over ``world_size`` ranks (``ranks`` names them in the error), after the
    checks that the global batch and the micro-batch divide evenly."""
    if config.global_train_batch_size % world_size:
        raise ConfigError(f'global_train_batch_size={config.global_train_batch_size} is not divisible by {ranks}')
    per_device = config.global_train_batch_size // world_size
    if per_device % config.device_train_microbatch_size:
        raise ConfigError(f'device_train_microbatch_size={config.device_train_microbatch_size} does not divide the '
                          f'per-device batch of {per_device} (= {config.global_train_batch_size} / {world_size})')
    return per_device


def config_to_dict(config: TrainConfig) -> dict:
    """The checked config as plain data, for logging as hyper-parameters and saving beside a run: a value that an
    ``${oc.env:NAME}`` went into is shown as written with the expression, not with the environment's value."""
    return show_env_values(dataclasses.asdict(config), getattr(config, 'env_values', {}))
