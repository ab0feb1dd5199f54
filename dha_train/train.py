"""YAML recipe -> Composer Trainer. Only assembles; every part is built elsewhere.

Launch:  composer -n 8 -m dha_train.train yamls/pretrain/llama2_7b_cpt.yaml save_folder=... run_name=...
         dha-train train yamls/pretrain/tiny.yaml key=value ...      (one process)
"""

from __future__ import annotations

import atexit
import functools
import gc
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from composer import Trainer
from composer.utils import FSDP2Config, dist, get_device, partial_format, reproducibility

import dha_train.algorithms  # noqa: F401  (each module registers its algorithm)
import dha_train.callbacks  # noqa: F401  (each module registers its callback)
from dha_train import registry
from dha_train.builders import build_model, build_model_config, wrap_composer
from dha_train.checkpoint_saving import refuse_later_checkpoints, save_checkpoints_atomically
from dha_train.checkpoints import LATEST, CheckpointError, check_checkpoint, refuse_tar
from dha_train.config import ConfigError, TrainConfig, config_to_dict, load_config, per_device_batch
from dha_train.data.loaders import build_evaluators, build_train_dataloader, check_data_matches_model
from dha_train.data.tokenizer import load_tokenizer
from dha_train.distributed import average_fsdp_gradients
from dha_train.errors import DhaTrainError, user_error
from dha_train.model_card import RUN_RECORD
from dha_train.optim import build_optimizer, build_scheduler
from dha_train.paths import check_writable, write_file_atomically


def resolve_device_and_precision(config: TrainConfig) -> tuple[str, str]:
    device = config.device
    if device == 'auto':
        device = 'gpu' if torch.cuda.is_available() else 'cpu'
    if device == 'gpu' and not torch.cuda.is_available():
        raise ConfigError('device: gpu was asked for but torch sees no CUDA device')
    precision = config.precision
    if precision == 'auto':
        precision = 'amp_bf16' if device == 'gpu' else 'fp32'
    if device == 'cpu' and precision != 'fp32':
        raise ConfigError(f'precision: {precision} needs a GPU; use fp32 (or auto) on CPU')
    return device, precision


def _local_save_folder(config: TrainConfig) -> Path | None:
    """The run's save_folder as a local path with {run_name} filled in; None for a remote one or none."""
    if not config.save_folder or '://' in config.save_folder:
        return None
    return Path(partial_format(config.save_folder, run_name=config.run_name) if config.run_name
                else config.save_folder)


def _refuse_on_every_rank(check, *, on_every_node: bool = False) -> None:
    """Run ``check`` on global rank 0 only (``on_every_node``: on every node's local rank 0, for a check of files each
    node reads from its own disk) and raise the DhaTrainError it raised there on every rank, so all ranks stop
    together with the same one line."""
    checks_here = dist.get_local_rank() == 0 if on_every_node else dist.get_global_rank() == 0
    problem: DhaTrainError | None = None
    if checks_here:
        try:
            check()
        except DhaTrainError as exc:
            problem = exc
    if on_every_node:
        found = [exc for exc in dist.all_gather_object(problem) if exc is not None]
        if found:
            raise found[0]
        return
    problems: list[DhaTrainError | None] = [problem]
    dist.broadcast_object_list(problems, src=0)
    if problems[0] is not None:
        raise problems[0]


def check_checkpoint_to_load(config: TrainConfig) -> None:
    """Refuse, before anything is built, the checkpoint Composer would load: autoresume's latest link in a local
    save_folder when there is one (Composer then ignores load_path), else load_path. Every node's local rank 0 checks
    its own copy (nodes need not share storage) and every rank raises the same CheckpointError; the save folder is
    left exactly as it is. A tar archive is refused, local or remote (Composer would extract it). A remote load_path
    (or a remote save_folder's latest checkpoint) is downloaded by Composer itself and read only through the checked
    loaders ``dha_train.checkpoints`` installs, so it is refused at that read, before any of its state is used."""
    if config.load_path:
        refuse_tar(config.load_path, 'load_path: ')
    setting = path = note = None
    folder = _local_save_folder(config) if config.autoresume else None
    if folder is not None and ((folder / LATEST).is_symlink() or (folder / LATEST).exists()):
        setting, path = 'autoresume', folder / LATEST
        note = (f'; it is what {path} names, and nothing in {folder} was changed: point {LATEST} at an earlier '
                'checkpoint there to resume from that one')
    if path is None and config.load_path and '://' not in config.load_path:
        # Composer formats {run_name}; without one in the config it draws a random name
        setting, note = 'load_path', ''
        path = Path(partial_format(config.load_path, run_name=config.run_name) if config.run_name
                    else config.load_path)
    if path is None:
        return

    def check() -> None:
        try:
            check_checkpoint(path)
        except CheckpointError as exc:
            raise CheckpointError(f'{setting}: {exc}{note}') from exc

    _refuse_on_every_rank(check, on_every_node=True)


def check_save_folder(config: TrainConfig) -> None:
    """Refuse, before anything is built, a local save_folder the run could not save into: one this process cannot
    write, or one holding checkpoints later than the point the run starts from (Composer refuses that folder only at
    fit start, with a traceback; a run killed while it saved could leave one). Global rank 0 checks and every rank
    raises the same error; nothing in the folder is changed."""
    folder = _local_save_folder(config)
    if folder is None or '{' in str(folder):
        return  # remote, or named after a run name Composer draws at random: a new folder

    def check() -> None:
        check_writable(folder, 'save_folder')
        if folder.is_dir() and not config.save_overwrite:
            link = folder / LATEST
            if config.autoresume and link.is_symlink():
                refuse_later_checkpoints(folder, folder / os.readlink(link), 'autoresume')
            elif config.load_path and not config.load_weights_only:
                refuse_later_checkpoints(folder, Path(config.load_path), 'load_path')
            else:
                refuse_later_checkpoints(folder, None, 'autoresume' if config.autoresume else 'save_folder')

    _refuse_on_every_rank(check)


def read_cpu_model_without_a_subprocess() -> None:
    """Have Composer read the CPU's model name (recorded in every checkpoint's metadata) from /proc/cpuinfo.

    Composer asks py-cpuinfo, which starts a Python process of its own to probe the CPU: ~1 s of CPU at each rank's
    start, for one line of text. The line in /proc/cpuinfo is the name py-cpuinfo reports (``brand_raw``); where
    there is no such file, Composer's own probe runs as before."""
    from composer.utils import collect_env

    probe = collect_env.get_cpu_model
    if getattr(probe, 'reads_proc_cpuinfo', False):
        return

    @functools.lru_cache(maxsize=1)
    def cpu_model() -> str:
        try:
            lines = Path('/proc/cpuinfo').read_text().splitlines()
        except OSError:
            lines = []
        names = [line.split(':', 1)[1].strip() for line in lines if line.startswith('model name') and ':' in line]
        return names[0] if names and names[0] else probe()

    cpu_model.reads_proc_cpuinfo = True
    collect_env.get_cpu_model = cpu_model


def build_trainer(config: TrainConfig, extra_loggers: Sequence = (), extra_callbacks: Sequence = ()):
    """Assemble data, model, optimizer, schedule, algorithms, callbacks and loggers into a Composer Trainer."""
    device, precision = resolve_device_and_precision(config)
    # Components first: a misspelt key or a bad value in a recipe's algorithms, callbacks or loggers fails here,
    # before any process group, data loader or model exists.
    loggers = registry.loggers.build_all(config.loggers) + list(extra_loggers)
    callbacks = registry.callbacks.build_all(config.callbacks) + list(extra_callbacks)
    algorithms = registry.algorithms.build_all(config.algorithms)
    # Join the process group before any StreamingDataset exists: otherwise each dataset opens and tears down a
    # temporary group of its own on the same port, and ranks race each other.
    dist.initialize_dist(get_device(device), timeout=config.dist_timeout)
    world_size = dist.get_world_size()
    device_batch_size = per_device_batch(config, world_size, f'the {world_size} processes of this launch')
    check_checkpoint_to_load(config)
    check_save_folder(config)
    save_checkpoints_atomically()
    read_cpu_model_without_a_subprocess()

    # Cheap checks first: data layout, vocabulary and sequence length against the model config.
    llama_config = build_model_config(config.model)
    tokenizer_path = config.model.tokenizer or config.model.pretrained_path
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else None
    if tokenizer is not None and len(tokenizer) > llama_config.vocab_size:
        raise ConfigError(f'model: tokenizer {tokenizer_path} has {len(tokenizer)} tokens but the model has '
                          f'vocab_size={llama_config.vocab_size}')
    for where, loader_cfg in (('train_loader', config.train_loader), ('eval_loader', config.eval_loader)):
        if loader_cfg is not None and loader_cfg.remote is None:
            if not Path(loader_cfg.root).is_dir():
                raise ConfigError(f"{where}.root: data folder '{loader_cfg.root}' does not exist "
                                  '(write it with `dha-train data prep`)')
            check_data_matches_model(loader_cfg.root, vocab_size=llama_config.vocab_size,
                                     max_seq_len=llama_config.max_position_embeddings, where=where,
                                     tokenizer=tokenizer)
    train_loader = build_train_dataloader(config.train_loader, device_batch_size=device_batch_size, seed=config.seed)
    evaluators = []
    if config.eval_loader is not None:
        evaluators = build_evaluators(config.eval_loader, device_batch_size=config.device_eval_batch_size,
                                      metric_names=['LanguageCrossEntropy', 'LanguagePerplexity'])

    # Same seed on every rank, so every rank that builds weights builds the same ones before FSDP shards them. Under
    # FSDP with several processes only rank 0 does (model.load_on_rank0): the others build the model on the meta
    # device, and Composer's FSDP2 broadcasts rank 0's weights as it shards the model.
    reproducibility.seed_all(config.seed)
    fsdp_enabled = config.fsdp is not None and config.fsdp.enabled
    on_meta_device = (config.model.load_on_rank0 and fsdp_enabled and world_size > 1
                      and dist.get_global_rank() != 0)
    model = wrap_composer(build_model(config.model, on_meta_device=on_meta_device), tokenizer)
    optimizer = build_optimizer(model, config.optimizer)

    parallelism_config = None
    if config.fsdp is not None and config.fsdp.enabled:
        parallelism_config = {'fsdp': FSDP2Config(
            reshard_after_forward=config.fsdp.reshard_after_forward,
            state_dict_type=config.fsdp.state_dict_type,
            mixed_precision=config.fsdp.mixed_precision,
            activation_cpu_offload=config.fsdp.activation_cpu_offload,
        )}

    trainer = Trainer(
        run_name=config.run_name,
        model=model,
        train_dataloader=train_loader,
        eval_dataloader=evaluators or None,
        eval_interval=config.eval_interval if evaluators else 1,
        max_duration=config.max_duration,
        optimizers=optimizer,
        schedulers=build_scheduler(config.scheduler),
        algorithms=algorithms,
        callbacks=callbacks,
        loggers=loggers,
        device=device,
        precision=precision,
        device_train_microbatch_size=config.device_train_microbatch_size,
        parallelism_config=parallelism_config,
        seed=config.seed,
        save_folder=config.save_folder,
        save_interval=config.save_interval,
        save_num_checkpoints_to_keep=config.save_num_checkpoints_to_keep,
        save_overwrite=config.save_overwrite,
        autoresume=config.autoresume,
        load_path=config.load_path,
        load_weights_only=config.load_weights_only,
        console_log_interval=config.console_log_interval,
        progress_bar=config.progress_bar,
        log_to_console=not config.progress_bar and 'console' not in config.loggers,
        dist_timeout=config.dist_timeout,
    )
    # gloo sums where FSDP2 asks it to average; see average_fsdp_gradients.
    if average_fsdp_gradients(trainer.state.model) and dist.get_global_rank() == 0:
        print(f'dha_train: this backend sums FSDP2 gradients over ranks; dividing by the {world_size} ranks',
              flush=True)
    trainer.logger.log_hyperparameters({'dha_train_config': config_to_dict(config)})
    if config.save_folder is not None and dist.get_global_rank() == 0 and '://' not in config.save_folder:
        folder = Path(config.save_folder.format(run_name=trainer.state.run_name))
        folder.mkdir(parents=True, exist_ok=True)
        # as checkpoints are: a link planted at the name is replaced, not written through
        write_file_atomically(folder / 'dha_train_config.json', json.dumps(config_to_dict(config), indent=2))
    return trainer


def close_trainer(trainer) -> None:
    """Close a trainer for good when the process goes on to build others (quickstart stages, benchmarks): Composer
    keeps an exit hook that holds the whole training state, so without this each run's model, optimizer and
    (GPU) memory would live until the process ends."""
    trainer.close()
    atexit.unregister(trainer.engine._close)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def is_finished(trainer) -> bool:
    state = trainer.state
    return state.timestamp.get(state.max_duration.unit) >= state.max_duration


def _record_run(config: TrainConfig, run_name: str, recipe: str | None) -> None:
    """Write the run's start folder and recipe next to its checkpoints (global rank 0, local save folders only).
    Kept out of the checkpoint itself: a new key there would stop older sharded checkpoints from resuming."""
    folder = _local_save_folder(config)
    if folder is None or dist.get_global_rank() != 0:
        return
    folder.mkdir(parents=True, exist_ok=True)
    start = config.model.pretrained_path
    record = {'run_name': run_name, 'recipe': recipe,
              'start': str(Path(start).resolve()) if start and '://' not in str(start) else start}
    write_file_atomically(folder / RUN_RECORD, json.dumps(record, indent=2) + '\n')


def train(config: TrainConfig, extra_loggers: Sequence = (), extra_callbacks: Sequence = (),
          recipe: str | None = None):
    """Build the trainer and fit. A run that autoresumes into a finished state is reported done, not restarted.
    ``recipe``: the YAML file, recorded for the export's model card."""
    trainer = build_trainer(config, extra_loggers, extra_callbacks)
    _record_run(config, trainer.state.run_name, recipe)
    start_batch = int(trainer.state.timestamp.batch)
    if dist.get_global_rank() == 0:
        print(f'dha_train: run {trainer.state.run_name} starts at batch {start_batch} of {trainer.state.max_duration}',
              flush=True)
    if is_finished(trainer):
        if dist.get_global_rank() == 0:
            print(f'dha_train: run {trainer.state.run_name} already finished; nothing to train', flush=True)
        return trainer
    if config.eval_first and start_batch == 0 and trainer.state.evaluators:
        trainer.eval()
    trainer.fit()
    return trainer


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ('-h', '--help'):
        print(__doc__)
        print('usage: python -m dha_train.train <recipe.yaml> [key=value ...]')
        return 0 if argv else 2
    try:
        config = load_config(argv[0], argv[1:])
        trainer = train(config, recipe=argv[0])
    except Exception as exc:
        error = user_error(exc)  # a DhaTrainError, or a disk that refused a write
        if error is None:
            raise
        print(f'dha-train: error: {error}', file=sys.stderr)
        return 2
    trainer.close()
    return 0


if __name__ == '__main__':
    sys.exit(main())
