"""`dha-train plan`: what a recipe needs per rank before the cluster is asked, measured on this CPU with no memory.

The run is built as ``dha-train train`` builds it (the config check, the model from its config, every algorithm's
``Event.INIT`` surgery, activation checkpointing, the precision's FSDP2 mixed-precision policy, the FSDP2 wrap of
each decoder layer and the root, the optimizer's parameter groups, a distillation teacher sharded like the student)
but every tensor is a fake one (``FakeTensorMode``) and the process group is a fake one of the recipe's world size.
Two training steps of the recipe's micro-batch then run under PyTorch's ``FSDPMemTracker``, which reports this
rank's peak by category. No GPU, no weights and no data are needed: a model folder holding ``config.json`` is
enough.

Each fake step runs the algorithms' own FIT_START, AFTER_FORWARD and AFTER_LOSS code (a distillation teacher's
forward, the transfer MSE, the fusion penalty), with the teacher the plan built. Not measured: the data loader's
pinned buffers. Aligned GQA's L0 gates read a fake gate buffer as open (a run's start). What the tracker does not
see is added as a stated reserve (``RESERVE_GIB``: the CUDA context and NCCL buffers) and a fragmentation allowance
(``FRAGMENTATION``) before the verdict.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from composer.core import Event, Time, TimeUnit
from composer.optim import DecoupledAdamW

import dha_train.algorithms  # noqa: F401  (each module registers its algorithm)
from dha_train import registry
from dha_train.builders import build_model_config, wrap_composer
from dha_train.config import ConfigError, TrainConfig, load_config, per_device_batch
from dha_train.data.prep import MANIFEST_NAME, read_manifest
from dha_train.distributed import causal_lm_on_meta, shard_blocks
from dha_train.model_folders import load_model_config, weights_optional
from dha_train.models.llama_layout import attention_head_widths
from dha_train.optim import build_optimizer
from dha_train.plan_probes import PROBE_DEPTHS, MemoryReading, cut_to, extrapolated, probe_layers
from dha_train.weight_sizes import parameter_count

GIB = 2 ** 30
RESERVE_GIB = 2.0  # CUDA context (~0.5 GiB) and NCCL's buffers (~1 GiB at 8 ranks), which the tracker cannot see
FRAGMENTATION = 0.05  # of the tracked peak: the caching allocator's blocks are rounded and fragment


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float  # what nvidia-smi reports as the card's memory
    bf16_flops: float  # dense bf16 tensor-core peak, FLOP/s


GPUS = {
    'a100-40g': Gpu('A100 40GB', 40.0, 312e12),
    'a100-80g': Gpu('A100 80GB', 80.0, 312e12),
    'h100-80g': Gpu('H100 SXM 80GB', 79.6, 989e12),
    'h200': Gpu('H200 141GB', 140.4, 989e12),
    'b200': Gpu('B200 180GB', 179.1, 2250e12),
}
# MFU prior: PyTorch's FSDP2 LLaMA-2-7B runs on A100s report 0.4-0.57 ("Maximizing training throughput using
# PyTorch FSDP", 2024); 0.40 is the low end, for a recipe nobody has timed yet.
DEFAULT_MFU = 0.40


def gpu_spec(name: str) -> Gpu:
    """A named GPU, or a plain number of GiB (a card not in the table: its FLOPs are taken as the A100's)."""
    if name in GPUS:
        return GPUS[name]
    try:
        gib = float(name)
    except ValueError:
        raise ConfigError(f"plan: --gpu must be one of {', '.join(GPUS)} or a memory size in GiB, got '{name}'") \
            from None
    if gib <= 0:
        raise ConfigError(f'plan: --gpu must be a positive number of GiB, got {name}')
    return Gpu(f'{gib:g} GiB', gib, GPUS['a100-80g'].bf16_flops)


class _FirstStep:
    """Stands for the step counter: Composer's AdamW reads it with ``.item()``, which a fake tensor cannot answer."""

    @staticmethod
    def item() -> float:
        return 1.0


class _PlanningAdamW(DecoupledAdamW):
    """Composer's DecoupledAdamW, the same state (exp_avg, exp_avg_sq, step) and the same arithmetic, runnable on
    fake tensors."""

    @staticmethod
    def adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, **options):
        DecoupledAdamW.adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, [_FirstStep()] * len(state_steps),
                             **options)


@contextlib.contextmanager
def _planning_process_group(world_size: int) -> Iterator:
    """A fake process group of ``world_size`` ranks (this process is rank 0) and its device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError('plan: a process group is already initialised in this process; run the plan on its own')
    dist.init_process_group('fake', rank=0, world_size=world_size, store=FakeStore())
    try:
        yield init_device_mesh('cpu', (world_size,))
    finally:
        dist.destroy_process_group()


def _mixed_precision(config: TrainConfig):
    """(precision, Composer's own FSDP2 policy for it): what the run would get on a GPU."""
    from composer.core import Precision
    from composer.distributed.fsdp2 import create_mixed_precision_policy

    precision = config.precision if config.precision != 'auto' else 'amp_bf16'  # what `auto` is on a GPU
    mixed = config.fsdp.mixed_precision if config.fsdp is not None else 'DEFAULT'
    return precision, create_mixed_precision_policy(Precision(precision), mixed)


def measure(config: TrainConfig, world_size: int, microbatch: int, seq_len: int, steps: int = 2,
            exact: bool = False) -> dict:
    """The per-rank peak of ``steps`` fake training steps of ``microbatch`` x ``seq_len`` tokens at ``world_size``.

    A model deeper than ``PROBE_DEPTHS`` allows is measured at two probes (its first 3 layers, then those and its
    widest later layer, with the teacher, the attention-transfer source and the head map cut alike) and extrapolated
    layer by layer (see ``extrapolated``); ``exact`` measures every layer instead (about 0.8 s a layer of LLaMA-2-7B
    on one core)."""
    depth = build_model_config(config.model).num_hidden_layers
    if exact or depth <= PROBE_DEPTHS[-1] + 2:
        return _measure(config, world_size, microbatch, seq_len, steps)
    with _planning_process_group(world_size):
        full = _built(config)
        teacher_config = full.teacher_config
        teacher_layers = teacher_config.num_hidden_layers if teacher_config is not None else 0
        layer_sizes = _layer_sizes(full.hf)
        all_parameters = sum(p.numel() for p in full.hf.parameters())
        teacher_parameters = _teacher_parameters(teacher_config)
    probes = probe_layers(layer_sizes)
    with tempfile.TemporaryDirectory() as scratch:
        shallow, deep = (_measure(cut_to(config, layers, Path(scratch) / str(len(layers))), world_size, microbatch,
                                  seq_len, steps) for layers in probes)
    return extrapolated(shallow, deep, probes[1], layer_sizes, teacher_layers, all_parameters=all_parameters,
                         teacher_parameters=teacher_parameters)


def _measure(config: TrainConfig, world_size: int, microbatch: int, seq_len: int, steps: int) -> dict:
    """``measure`` at the model's own depth: every layer built and tracked."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    with _planning_process_group(world_size) as mesh:
        built = _built(config)
        hf, algorithms, state, precision, policy = (built.hf, built.algorithms, built.state, built.precision,
                                                    built.policy)
        layer_sizes = _layer_sizes(hf)
        with FakeTensorMode(allow_non_fake_inputs=True):
            hf.to_empty(device='cpu')  # every tensor fake: shapes and dtypes, no memory
            shard_blocks(hf, mesh, mp_policy=policy,
                         reshard_after_forward=config.fsdp.reshard_after_forward if config.fsdp else True)
            named = dict(hf.named_parameters())
            optimizer = _PlanningAdamW([{**{k: v for k, v in g.items() if k != 'names'},
                                          'params': [named[n] for n in g['names'] if n in named]}
                                         for g in built.groups],
                                         **{key: built.optimizer.defaults[key] for key in ('lr', 'betas', 'eps',
                                                                                            'weight_decay')})
            tracker = FSDPMemTracker(hf, optimizer)
            teacher = None
            with tracker:
                if built.teacher_config is not None:  # a second FSDP root, built inside the tracker: counted
                    teacher = causal_lm_on_meta(built.teacher_config)
                    teacher.requires_grad_(False).eval()
                    teacher.to_empty(device='cpu')
                    shard_blocks(teacher, mesh, mp_policy=policy)
                    for algorithm in algorithms:  # distillation runs it (AFTER_FORWARD); it would load weights
                        if getattr(algorithm, 'teacher_path', None):
                            algorithm.teacher = teacher
                built.run_event(Event.FIT_START)
                vocab = hf.config.vocab_size
                for step in range(steps):
                    ids = torch.randint(0, vocab, (microbatch, seq_len))
                    state.batch = {'input_ids': ids, 'labels': ids}
                    autocast = (torch.autocast('cpu', dtype=policy.param_dtype) if precision != 'fp32'
                                else torch.autocast('cpu', enabled=False))
                    with autocast:
                        state.outputs = hf(input_ids=ids, labels=ids)
                        built.run_event(Event.AFTER_FORWARD)
                        state.loss = state.outputs['loss']
                        built.run_event(Event.AFTER_LOSS)
                    state.loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    if step == 0:
                        tracker.reset_mod_stats()
            peak = next(iter(tracker.get_tracker_snapshot('peak').values()))
            teacher_bytes = sum(_local_bytes(p) for p in teacher.parameters()) if teacher else 0
            checkpoint_bytes = world_size * (sum(_local_bytes(p) for p in hf.parameters())
                                             + sum(_local_bytes(t) for s in optimizer.state.values()
                                                   for t in s.values() if torch.is_tensor(t)))
        return {'reading': _categories(peak, teacher_bytes), 'checkpoint_bytes': checkpoint_bytes,
                'all_parameters': sum(p.numel() for p in named.values()),  # a DTensor's numel is the full tensor's
                'teacher_parameters': sum(p.numel() for p in teacher.parameters()) if teacher else 0,
                'precision': precision,
                'layer_sizes': layer_sizes, 'depth': len(layer_sizes), 'extrapolated_from': None}


@dataclass
class _Built:
    """A run as ``dha-train train`` builds it, on the meta device, after every algorithm's INIT surgery."""
    hf: torch.nn.Module
    optimizer: torch.optim.Optimizer
    groups: list  # the optimizer's parameter groups by parameter name (sharding replaces every parameter)
    algorithms: list
    state: SimpleNamespace
    precision: str
    policy: object
    teacher_config: object

    def run_event(self, event: Event) -> None:  # the algorithms' own code, at the events a training step has
        for algorithm in self.algorithms:
            if algorithm.match(event, self.state):
                algorithm.apply(event, self.state, None)


def _built(config: TrainConfig) -> _Built:
    llama_config = build_model_config(config.model)
    llama_config.use_cache = False  # training: the recompute of a checkpointed layer must not grow a cache
    precision, policy = _mixed_precision(config)
    # Built on the meta device, as a rank that receives rank 0's weights builds it; every algorithm's INIT surgery
    # runs there (they support it: no weights are read), then the tensors become fake ones.
    hf = causal_lm_on_meta(llama_config)
    if config.model.activation_checkpointing:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})
    model = wrap_composer(hf)
    optimizer = build_optimizer(model, config.optimizer)
    algorithms = registry.algorithms.build_all(config.algorithms)
    # the parts of Composer's State the algorithms read; the fake steps are the run's first ones
    state = SimpleNamespace(model=model, optimizers=[optimizer], rank_zero_seed=config.seed, fsdp_config=None,
                            device=None, get_elapsed_duration=lambda: None)
    built = _Built(hf, optimizer, [], algorithms, state, precision, policy, None)
    built.run_event(Event.INIT)
    names = {id(parameter): name for name, parameter in hf.named_parameters()}
    built.groups = [{**{k: v for k, v in group.items() if k != 'params'},
                     'names': [names[id(p)] for p in group['params']]} for group in optimizer.param_groups]
    teacher_path = next((getattr(a, 'teacher_path', None) for a in algorithms if getattr(a, 'teacher_path', None)),
                        None)
    if teacher_path is not None:
        built.teacher_config = load_model_config(teacher_path, who='distillation teacher_path')
    return built


def _layer_sizes(hf: torch.nn.Module) -> list[tuple[int, int]]:
    """(parameters, trainable parameters) of each decoder layer, after the INIT surgery."""
    return [(sum(p.numel() for p in layer.parameters()),
             sum(p.numel() for p in layer.parameters() if p.requires_grad)) for layer in hf.model.layers]


def _teacher_parameters(teacher_config) -> int:
    if teacher_config is None:
        return 0
    return parameter_count(teacher_config)


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, 'to_local') else tensor
    return local.numel() * local.element_size()


def _categories(peak: dict, teacher_bytes: int) -> MemoryReading:
    by = {str(key).split('.')[-1]: value for key, value in peak.items() if str(key) != 'Total'}
    parameters = by.get('SHARDED_PARAM', 0) + by.get('UNSHARDED_PARAM', 0)
    teacher = min(teacher_bytes, parameters)  # the teacher's shards are parameters to the tracker
    return MemoryReading(
        parameters=parameters - teacher, gradients=by.get('SHARDED_GRAD', 0) + by.get('UNSHARDED_GRAD', 0),
        optimizer=by.get('OPT', 0), activations=by.get('ACT', 0) + by.get('TEMP', 0) + by.get('INP', 0),
        fsdp_buffers=by.get('ALL_GATHER', 0) + by.get('REDUCE_SCATTER', 0), teacher=teacher,
        other=by.get('BUFFER', 0) + by.get('OTH', 0))


def flops_per_token(config, all_parameters: int, teacher_parameters: int, seq_len: int) -> float:
    """Model FLOPs per trained token: 6 per weight (forward and backward) for the trained model, 2 per weight for a
    frozen teacher's forward, plus attention's score and value products, 6 L h (d_qk + d_v) s (PaLM, appendix B, at
    d_qk = d_v = d: 12 L h d s; the full s x s matrix, as MFU conventions count it). Frozen weights of the student
    still run forward and backward (their activations' gradients flow), so every student weight counts 6."""
    query_key, value = attention_head_widths(config)
    attention = 6 * config.num_hidden_layers * config.num_attention_heads * (query_key + value) * seq_len
    return 6 * all_parameters + 2 * teacher_parameters + attention


def run_tokens(config: TrainConfig, seq_len: int) -> int:
    duration = Time.from_timestring(config.max_duration)
    if duration.unit == TimeUnit.BATCH:
        return duration.value * config.global_train_batch_size * seq_len
    if duration.unit == TimeUnit.TOKEN:
        return duration.value
    if duration.unit == TimeUnit.SAMPLE:
        return duration.value * seq_len
    raise ConfigError(f'plan: max_duration {config.max_duration} is in {duration.unit.value}; the plan needs '
                      'batches, samples or tokens to predict the wall time')


def plan_recipe(recipe: str, overrides: Sequence[str] = (), world_size: int = 8, gpu: str = 'a100-80g',
                mfu: float = DEFAULT_MFU, exact: bool = False, search_largest: bool = True,
                seq_len: int | None = None) -> dict:
    """The plan of ``recipe`` with ``overrides`` (see the module docstring); model folders need no weights.
    ``seq_len``: the training sequence (the data prep's ``--seq-len``); the model's context length by default."""
    import torch.distributed as dist

    _checked(recipe, overrides, world_size, gpu, mfu, seq_len)  # bad settings are named here, before any process
    if dist.is_initialized():  # after an in-process run (Composer's one-rank group): the fake group needs its own
        return _plan_in_child(recipe, overrides, world_size, gpu, mfu, exact, seq_len)
    with weights_optional():
        return _plan(recipe, overrides, world_size, gpu, mfu, exact, search_largest, seq_len)


def _checked(recipe: str, overrides: Sequence[str], world_size: int, gpu: str, mfu: float,
             seq_len: int | None) -> tuple:
    """(the GPU, the config, the per-rank batch, the sequence) after the checks of the plan's own settings."""
    if world_size < 1:
        raise ConfigError(f'plan: --world-size must be >= 1, got {world_size}')
    if not 0 < mfu <= 1:
        raise ConfigError(f'plan: --mfu must be in (0, 1], got {mfu}')
    card = gpu_spec(gpu)
    config = load_config(recipe, overrides)
    per_rank = per_device_batch(config, world_size, f'--world-size {world_size}')
    with weights_optional():
        context = build_model_config(config.model).max_position_embeddings
    if seq_len is not None and not 1 <= seq_len <= context:
        raise ConfigError(f'plan: --seq-len must be in 1..{context} (the model\'s max_position_embeddings), '
                          f'got {seq_len}')
    return card, config, per_rank, seq_len or _data_seq_len(config) or context


def _data_seq_len(config: TrainConfig) -> int | None:
    """The sequence length the recipe's training data was prepared with (its ``manifest.json``), when the data
    folder is there: what a run will train on, better than the model's context as the plan's default."""
    root = getattr(config.train_loader, 'root', None)
    if not root or not (Path(root) / MANIFEST_NAME).is_file():
        return None
    try:
        return int(read_manifest(root)['seq_len'])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _plan_in_child(recipe: str, overrides: Sequence[str], world_size: int, gpu: str, mfu: float,
                   exact: bool, seq_len: int | None) -> dict:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, '-m', 'dha_train.cli', 'plan', str(recipe), *overrides, '--world-size',
                           str(world_size), '--gpu', gpu, '--mfu', str(mfu), '--json', *(['--exact'] if exact else []),
                           *(['--seq-len', str(seq_len)] if seq_len else [])],
                          capture_output=True, text=True)
    try:
        return json.loads(done.stdout)  # printed before a does-not-fit refusal too
    except json.JSONDecodeError:
        raise ConfigError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else
                          f'plan: the planning process failed (exit {done.returncode})') from None


def _plan(recipe: str, overrides: Sequence[str], world_size: int, gpu: str, mfu: float, exact: bool,
          search_largest: bool, seq_len: int | None) -> dict:
    card, config, per_rank, seq_len = _checked(recipe, overrides, world_size, gpu, mfu, seq_len)
    microbatch = config.device_train_microbatch_size
    llama_config = build_model_config(config.model)
    measured = measure(config, world_size, microbatch, seq_len, exact=exact)
    reading = measured['reading']
    usable = (card.memory_gib - RESERVE_GIB) * GIB
    needed = reading.total * (1 + FRAGMENTATION)
    flops = flops_per_token(llama_config, measured['all_parameters'], measured['teacher_parameters'], seq_len)
    tokens_per_s = mfu * card.bf16_flops * world_size / flops
    tokens = run_tokens(config, seq_len)
    largest = (largest_fitting_microbatch(config, world_size, seq_len, usable, per_rank, {microbatch: reading.total},
                                          exact) if search_largest else None)
    return {'recipe': str(recipe), 'world_size': world_size, 'gpu': card.name, 'gpu_memory_gib': card.memory_gib,
            'microbatch': microbatch, 'seq_len': seq_len, 'precision': measured['precision'],
            'activation_checkpointing': config.model.activation_checkpointing,
            'peak_gib': reading.total / GIB, 'needed_gib': needed / GIB, 'usable_gib': usable / GIB,
            'fits': needed <= usable, 'margin_gib': (usable - needed) / GIB, 'largest_microbatch': largest,
            'by_category_gib': {k: v / GIB for k, v in vars(reading).items()},
            'flops_per_token': flops, 'mfu': mfu, 'tokens_per_s': tokens_per_s, 'run_tokens': tokens,
            'wall_hours': tokens / tokens_per_s / 3600, 'checkpoint_gib': measured['checkpoint_bytes'] / GIB,
            'parameters': measured['all_parameters'], 'teacher_parameters': measured['teacher_parameters'],
            'layers': measured['depth'], 'extrapolated_from': measured['extrapolated_from'],
            'probe_layers': measured.get('probe_layers')}


def largest_fitting_microbatch(config: TrainConfig, world_size: int, seq_len: int, usable_bytes: float,
                               per_rank: int, known: dict[int, int], exact: bool = False) -> int | None:
    """The largest divisor of the per-rank batch whose peak (with the fragmentation allowance) fits: from the
    recipe's micro-batch up while it fits, or down until one does. ``known``: peaks measured already."""
    def fits(microbatch: int) -> bool:
        if microbatch not in known:
            known[microbatch] = measure(config, world_size, microbatch, seq_len, exact=exact)['reading'].total
        return known[microbatch] * (1 + FRAGMENTATION) <= usable_bytes

    divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
    start = divisors.index(config.device_train_microbatch_size)
    if fits(divisors[start]):
        best = divisors[start]
        for candidate in divisors[start + 1:]:
            if not fits(candidate):
                break
            best = candidate
        return best
    return next((candidate for candidate in reversed(divisors[:start]) if fits(candidate)), None)
