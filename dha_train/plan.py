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
pinned buffers. Known gap: aligned GQA's L0 gates read their frozen state with ``.item()``, which fake tensors cannot
answer, so its pruning recipe does not plan yet. What the tracker does not see is added as a stated reserve
(``RESERVE_GIB``: the CUDA context and NCCL buffers) and a fragmentation allowance (``FRAGMENTATION``) before the
verdict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from composer.core import Event, Time, TimeUnit
from composer.optim import DecoupledAdamW

import dha_train.algorithms  # noqa: F401  (each module registers its algorithm)
from dha_train import registry
from dha_train.builders import build_llama_config, wrap_composer
from dha_train.config import ConfigError, TrainConfig, load_config, per_device_batch
from dha_train.distributed import causal_lm_on_meta, shard_blocks
from dha_train.model_folders import weights_optional
from dha_train.optim import build_optimizer

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


@dataclass
class MemoryReading:
    """One rank's tracked peak, by category (bytes)."""
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    fsdp_buffers: int
    teacher: int
    other: int

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer + self.activations + self.fsdp_buffers
                + self.teacher + self.other)


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


def _planning_process_group(world_size: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError('plan: a process group is already initialised in this process; run the plan on its own')
    dist.init_process_group('fake', rank=0, world_size=world_size, store=FakeStore())
    return init_device_mesh('cpu', (world_size,))


def _mixed_precision(config: TrainConfig):
    """(precision, Composer's own FSDP2 policy for it): what the run would get on a GPU."""
    from composer.core import Precision
    from composer.distributed.fsdp2 import create_mixed_precision_policy

    precision = config.precision if config.precision != 'auto' else 'amp_bf16'  # what `auto` is on a GPU
    mixed = config.fsdp.mixed_precision if config.fsdp is not None else 'DEFAULT'
    return precision, create_mixed_precision_policy(Precision(precision), mixed)


def measure(config: TrainConfig, world_size: int, microbatch: int, seq_len: int, steps: int = 2) -> dict:
    """The per-rank peak of ``steps`` fake training steps of ``microbatch`` x ``seq_len`` tokens at ``world_size``."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    llama_config = build_llama_config(config.model)
    llama_config.use_cache = False  # training: the recompute of a checkpointed layer must not grow a cache
    mesh = _planning_process_group(world_size)
    try:
        precision, policy = _mixed_precision(config)
        # Built on the meta device, as a rank that receives rank 0's weights builds it; every algorithm's INIT
        # surgery runs there (they support it: no weights are read), then the tensors become fake ones.
        hf = causal_lm_on_meta(llama_config)
        if config.model.activation_checkpointing:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})
        model = wrap_composer(hf)
        optimizer = build_optimizer(model, config.optimizer)
        algorithms = registry.algorithms.build_all(config.algorithms)
        state = SimpleNamespace(model=model, optimizers=[optimizer], rank_zero_seed=config.seed, fsdp_config=None,
                                device=None)

        def run_event(event: Event) -> None:  # the algorithms' own code, at the events a training step has
            for algorithm in algorithms:
                if algorithm.match(event, state):
                    algorithm.apply(event, state, None)

        run_event(Event.INIT)
        # the optimizer's groups by parameter name: sharding replaces every parameter
        names = {id(parameter): name for name, parameter in hf.named_parameters()}
        groups = [{**{k: v for k, v in group.items() if k != 'params'},
                   'names': [names[id(p)] for p in group['params']]} for group in optimizer.param_groups]
        teacher_path = next((getattr(a, 'teacher_path', None) for a in algorithms
                             if getattr(a, 'teacher_path', None)), None)
        with FakeTensorMode(allow_non_fake_inputs=True):
            hf.to_empty(device='cpu')  # every tensor fake: shapes and dtypes, no memory
            shard_blocks(hf, mesh, mp_policy=policy,
                         reshard_after_forward=config.fsdp.reshard_after_forward if config.fsdp else True)
            named = dict(hf.named_parameters())
            optimizer = _PlanningAdamW([{**{k: v for k, v in g.items() if k != 'names'},
                                          'params': [named[n] for n in g['names'] if n in named]} for g in groups],
                                         **{key: optimizer.defaults[key] for key in ('lr', 'betas', 'eps',
                                                                                      'weight_decay')})
            tracker = FSDPMemTracker(hf, optimizer)
            teacher = None
            with tracker:
                if teacher_path is not None:  # a second FSDP root, built inside the tracker so it is counted
                    from transformers import AutoConfig

                    teacher = causal_lm_on_meta(AutoConfig.from_pretrained(teacher_path, local_files_only=True))
                    teacher.requires_grad_(False).eval()
                    teacher.to_empty(device='cpu')
                    shard_blocks(teacher, mesh, mp_policy=policy)
                    for algorithm in algorithms:  # distillation runs it (AFTER_FORWARD); it would load weights
                        if getattr(algorithm, 'teacher_path', None):
                            algorithm.teacher = teacher
                run_event(Event.FIT_START)
                vocab = llama_config.vocab_size
                for step in range(steps):
                    ids = torch.randint(0, vocab, (microbatch, seq_len))
                    state.batch = {'input_ids': ids, 'labels': ids}
                    autocast = (torch.autocast('cpu', dtype=policy.param_dtype) if precision != 'fp32'
                                else torch.autocast('cpu', enabled=False))
                    with autocast:
                        state.outputs = hf(input_ids=ids, labels=ids)
                        run_event(Event.AFTER_FORWARD)
                        state.loss = state.outputs['loss']
                        run_event(Event.AFTER_LOSS)
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
        reading = _categories(peak, teacher_bytes)
        return {'reading': reading, 'checkpoint_bytes': checkpoint_bytes,
                'all_parameters': sum(p.numel() for p in named.values()),  # a DTensor's numel is the full tensor's
                'teacher_parameters': sum(p.numel() for p in teacher.parameters()) if teacher else 0,
                'precision': precision}
    finally:
        dist.destroy_process_group()


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
    frozen teacher's forward, plus attention's score and value products, 12 L h d s (PaLM, appendix B: the full
    s x s matrix, as MFU conventions count it). Frozen weights of the student still run forward and backward
    (their activations' gradients flow), so every student weight counts 6."""
    heads = config.num_attention_heads
    head_dim = getattr(config, 'head_dim', None) or config.hidden_size // heads
    attention = 12 * config.num_hidden_layers * heads * head_dim * seq_len
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
                mfu: float = DEFAULT_MFU) -> dict:
    """The plan of ``recipe`` with ``overrides`` (see the module docstring); model folders need no weights."""
    import torch.distributed as dist

    _checked(recipe, overrides, world_size, gpu, mfu)  # bad settings are named here, before any process starts
    if dist.is_initialized():  # after an in-process run (Composer's one-rank group): the fake group needs its own
        return _plan_in_child(recipe, overrides, world_size, gpu, mfu)
    with weights_optional():
        return _plan(recipe, overrides, world_size, gpu, mfu)


def _checked(recipe: str, overrides: Sequence[str], world_size: int, gpu: str, mfu: float) -> tuple:
    """(the GPU, the config, the per-rank batch) after the checks of the plan's own settings."""
    if world_size < 1:
        raise ConfigError(f'plan: --world-size must be >= 1, got {world_size}')
    if not 0 < mfu <= 1:
        raise ConfigError(f'plan: --mfu must be in (0, 1], got {mfu}')
    card = gpu_spec(gpu)
    config = load_config(recipe, overrides)
    return card, config, per_device_batch(config, world_size, f'--world-size {world_size}')


def _plan_in_child(recipe: str, overrides: Sequence[str], world_size: int, gpu: str, mfu: float) -> dict:
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, '-m', 'dha_train.cli', 'plan', str(recipe), *overrides, '--world-size',
                           str(world_size), '--gpu', gpu, '--mfu', str(mfu), '--json'], capture_output=True, text=True)
    try:
        return json.loads(done.stdout)  # printed before a does-not-fit refusal too
    except json.JSONDecodeError:
        raise ConfigError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else
                          f'plan: the planning process failed (exit {done.returncode})') from None


def _plan(recipe: str, overrides: Sequence[str], world_size: int, gpu: str, mfu: float) -> dict:
    card, config, per_rank = _checked(recipe, overrides, world_size, gpu, mfu)
    microbatch = config.device_train_microbatch_size
    llama_config = build_llama_config(config.model)
    seq_len = llama_config.max_position_embeddings
    measured = measure(config, world_size, microbatch, seq_len)
    reading = measured['reading']
    usable = (card.memory_gib - RESERVE_GIB) * GIB
    needed = reading.total * (1 + FRAGMENTATION)
    flops = flops_per_token(llama_config, measured['all_parameters'], measured['teacher_parameters'], seq_len)
    tokens_per_s = mfu * card.bf16_flops * world_size / flops
    tokens = run_tokens(config, seq_len)
    largest = largest_fitting_microbatch(config, world_size, seq_len, usable, per_rank, {microbatch: reading.total})
    return {'recipe': str(recipe), 'world_size': world_size, 'gpu': card.name, 'gpu_memory_gib': card.memory_gib,
            'microbatch': microbatch, 'seq_len': seq_len, 'precision': measured['precision'],
            'activation_checkpointing': config.model.activation_checkpointing,
            'peak_gib': reading.total / GIB, 'needed_gib': needed / GIB, 'usable_gib': usable / GIB,
            'fits': needed <= usable, 'margin_gib': (usable - needed) / GIB, 'largest_microbatch': largest,
            'by_category_gib': {k: v / GIB for k, v in vars(reading).items()},
            'flops_per_token': flops, 'mfu': mfu, 'tokens_per_s': tokens_per_s, 'run_tokens': tokens,
            'wall_hours': tokens / tokens_per_s / 3600, 'checkpoint_gib': measured['checkpoint_bytes'] / GIB,
            'parameters': measured['all_parameters'], 'teacher_parameters': measured['teacher_parameters']}


def largest_fitting_microbatch(config: TrainConfig, world_size: int, seq_len: int, usable_bytes: float,
                               per_rank: int, known: dict[int, int]) -> int | None:
    """The largest divisor of the per-rank batch whose peak (with the fragmentation allowance) fits: from the
    recipe's micro-batch up while it fits, or down until one does. ``known``: peaks measured already."""
    def fits(microbatch: int) -> bool:
        if microbatch not in known:
            known[microbatch] = measure(config, world_size, microbatch, seq_len)['reading'].total
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
