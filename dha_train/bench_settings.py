"""What a `bench real` run reads: its settings, their defaults per device, and their checks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from dha_train.config import ConfigError

TASKS = ('piqa', 'arc_easy', 'arc_challenge', 'hellaswag', 'winogrande', 'sciq')
METHODS = ('mean_pool', 'aligned_gqa', 'asym_gqa', 'dha', 'dha_servable', 'mla', 'mla_deepseek', 'moh')
BUDGETS = ('kv1', 'kv2', 'half', 'third', 'eighth')
# the methods that keep whole K/V heads (pool, group or fuse them): a budget that is not a whole number of heads per
# layer, at least one, is out of their reach
HEAD_POOLING_METHODS = ('mean_pool', 'aligned_gqa', 'asym_gqa', 'dha', 'dha_servable')
SOURCE = 'smollm2-135m'
MOH_ACTIVE = 0.75


def moh_setting(num_heads: int) -> tuple[int, int]:
    """(shared heads, routed top-k) for MOH_ACTIVE of ``num_heads``: the nearest whole number of active heads, half
    the heads shared (rounded down), the rest of the active ones routed. 9 heads: 4 + top 3 of 5 = 7/9 (77.8%; 75%
    is 6.75 heads); 8 heads: 4 + top 2 of 4, the tiny recipe's setting."""
    active = math.floor(MOH_ACTIVE * num_heads + 0.5)
    shared = num_heads // 2
    return shared, max(active - shared, 1)


def budget_fraction(budget: str, source_kv_heads: int) -> float:
    """The budget's K+V cache as a fraction of the source's. ``kv1`` / ``kv2``: one or two K/V heads per layer (a third
    and two thirds of SmolLM2's three); ``half`` / ``third``: that fraction of any source's cache (a source with one
    K/V head, such as Gemma 3 270M, goes below it only through MLA's latent)."""
    fixed = {'half': 1 / 2, 'third': 1 / 3, 'eighth': 1 / 8}
    return fixed[budget] if budget in fixed else {'kv1': 1, 'kv2': 2}[budget] / source_kv_heads


def budget_heads(budget: str, source_kv_heads: int) -> int | None:
    """The K/V heads per layer a head-pooling method keeps at the budget; None where that is not a whole number of
    heads, at least one."""
    heads = budget_fraction(budget, source_kv_heads) * source_kv_heads
    whole = round(heads)
    return whole if whole >= 1 and abs(heads - whole) < 1e-9 else None


def check_budgets(budgets: Sequence[str], source_kv_heads: int) -> None:
    """Every budget must be below the source's cache: a budget at or above it compares nothing."""
    for budget in budgets:
        if budget_fraction(budget, source_kv_heads) >= 1:
            raise ConfigError(f'bench real: budget {budget} is not below the source\'s cache (it has '
                              f'{source_kv_heads} K/V head{"s" if source_kv_heads > 1 else ""} per layer); use half '
                              'or third')


@dataclass
class RealSettings:
    out: str = 'bench_real'
    device: str = 'auto'  # 'auto' (cuda when there is one), 'cpu' or 'cuda'
    tokens: int | None = None  # training tokens of every method (default: by device)
    limit: int | None = None  # documents per task, a seeded random sample of each split (default: by device)
    # documents per task of the intermediate rows (refit, attention transfer, DHA after Fusion): those that rank no
    # method; the first of the same seeded shuffle, so they pair with the ranking rows on the documents they share
    intermediate_limit: int | None = None
    seq_len: int | None = None
    batch: int | None = None  # global batch (sequences)
    microbatch: int | None = None
    val_tokens: int | None = None  # held-out validation tokens
    calib_tokens: int | None = None  # calibration tokens of align and the asym search
    refit_tokens: int | None = None  # calibration tokens of the healing refit
    search_batches: int | None = None  # DHA Search batches (not counted as training tokens: the Search makes a map)
    asym_iterations: int | None = None  # AsymGQA fitness-search iterations per layer (each a forward pass)
    eval_batch_size: int | None = None
    corpus_bytes: int | None = -1  # training corpus bytes per domain (-1: by device; None: the whole stdlib)
    methods: Sequence[str] = METHODS
    budgets: Sequence[str] = ('kv1', 'kv2')  # SmolLM2's; a one-K/V-head source takes half and third
    tasks: Sequence[str] = TASKS
    include: Sequence[str] = ()  # extra lm-eval task folders (tests: a local task)
    source: str = SOURCE  # a GGUF name/path for import_gguf, or an HF folder
    train_data: str | None = None  # an existing `data prep` folder (github + wikipedia) instead of the stdlib corpus
    seed: int = 17
    overrides: dict = field(default_factory=dict)  # recipe variables, e.g. {'lr': 5e-5}
    isolate_stages: bool = True  # each stage in a fresh process (False: all in this one; the tests' small runs)
    heal: bool = True  # healing rows (refit, attention transfer, KL) after each method's 0-token conversion
    ct: bool = True  # each method's own-training rows (CT, aligned GQA's pruning, MoH's continue-tuning; not DHA's)
    transfer_fraction: float = 0.5  # of the training tokens, for attention transfer; KL gets the rest
    transfer_lr: float = 3.0e-4  # attention transfer's peak lr (only the attention trains)
    kl_lr: float = 1.0e-4  # the KL stage's peak lr
    # The recovery curve: healing tokens (attention transfer + KL) at which each chain is scored, a ranking row each.
    # KL goes from each point to the next as its own stage, from the previous point's export on fresh batches, so a
    # long run stopped between points goes on from the last one done. Empty: one KL stage to the method's tokens.
    heal_points: Sequence[int] = ()


# Defaults per device. CPU: 400 sampled documents a task for the rows that rank methods, so a 6-task mean accuracy has
# a 95% half-width of about 0.02 (0.055 at the 50 first documents it used), 100 for the intermediate rows, and 65,536
# held-out tokens for every row; with the context-sharing scorer a ranking row's evaluation takes about 6 minutes of
# 2 cores on SmolLM2, an intermediate one about 2. The GPU one is a larger run.
_DEFAULTS = {
    'cpu': dict(tokens=16 * 8 * 256, limit=400, intermediate_limit=100, seq_len=256, batch=8, microbatch=8,
                val_tokens=256 * 256,
                calib_tokens=2048, refit_tokens=16384, search_batches=2, asym_iterations=3, eval_batch_size=16,
                corpus_bytes=4_000_000),
    'cuda': dict(tokens=400 * 32 * 512, limit=500, intermediate_limit=500, seq_len=512, batch=32, microbatch=32,
                 val_tokens=512 * 512,
                 calib_tokens=16384, refit_tokens=65536, search_batches=40, asym_iterations=50, eval_batch_size=64,
                 corpus_bytes=None),
}


def transfer_batches(settings: RealSettings, batches: int) -> int:
    """Attention transfer's batches of a healing chain of ``batches`` (at least one, and one left for KL)."""
    return min(max(1, round(batches * settings.transfer_fraction)), max(1, batches - 1))


def check_heal_points(settings: RealSettings) -> None:
    """--heal-points: increasing, whole batches, each past the transfer's tokens (every point trains KL)."""
    points = list(settings.heal_points)
    if not points:
        return
    batch_tokens = settings.batch * settings.seq_len
    batches = max(settings.tokens // batch_tokens, 1)
    transfer = transfer_batches(settings, batches) * batch_tokens
    if (any(point % batch_tokens for point in points) or points != sorted(set(points)) or points[0] <= transfer):
        raise ConfigError(f'bench real: --heal-points must increase, each a whole number of {batch_tokens}-token '
                          f'batches past the attention transfer\'s {transfer} tokens; got {points}')


def resolve_settings(settings: RealSettings) -> RealSettings:
    """Fill the device's defaults into the settings left unset, and check them."""
    device = settings.device
    if device == 'auto':
        device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if device not in _DEFAULTS:
        raise ConfigError(f"bench real: device must be auto, cpu or cuda, got '{settings.device}'")
    values = asdict(settings)
    values['device'] = device
    for key, default in _DEFAULTS[device].items():
        if key in ('microbatch', 'intermediate_limit'):
            continue
        if values[key] is None or (key == 'corpus_bytes' and values[key] == -1):
            values[key] = default
    if values['intermediate_limit'] is None:
        values['intermediate_limit'] = min(values['limit'], _DEFAULTS[device]['intermediate_limit'])
    if values['microbatch'] is None:
        values['microbatch'] = min(values['batch'], _DEFAULTS[device]['microbatch'])
    resolved = RealSettings(**values)
    for name in ('tokens', 'limit', 'intermediate_limit', 'seq_len', 'batch', 'microbatch', 'val_tokens',
                 'calib_tokens', 'refit_tokens',
                 'eval_batch_size', 'asym_iterations'):
        if getattr(resolved, name) <= 0:
            raise ConfigError(f'bench real: {name} must be > 0, got {getattr(resolved, name)}')
    check_heal_points(resolved)
    if resolved.intermediate_limit > resolved.limit:
        raise ConfigError(f'bench real: intermediate_limit ({resolved.intermediate_limit}) must not exceed limit '
                          f'({resolved.limit}): the intermediate rows are scored on part of the ranking rows\' '
                          'documents')
    if not 0 < resolved.transfer_fraction < 1:
        raise ConfigError(f'bench real: transfer_fraction must be in (0, 1), got {resolved.transfer_fraction}')
    if resolved.search_batches < 1:
        raise ConfigError(f'bench real: search_batches must be >= 1, got {resolved.search_batches}')
    if resolved.tokens < resolved.batch * resolved.seq_len:
        raise ConfigError(f'bench real: --tokens {resolved.tokens} is less than one batch '
                          f'({resolved.batch} x {resolved.seq_len} tokens)')
    for name, chosen, allowed in (('methods', resolved.methods, METHODS), ('budgets', resolved.budgets, BUDGETS)):
        unknown = sorted(set(chosen) - set(allowed))
        if unknown or not chosen:
            raise ConfigError(f'bench real: {name} must be among {", ".join(allowed)}, got {list(chosen)}')
    return resolved
