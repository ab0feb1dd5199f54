"""Calibration: run a source model of any family (``dha_train.families``) over N tokens and keep, per layer, what
the head searches and the refit need.

For each layer and each recorded kind (``key``: k_proj output before RoPE, and before k_norm in the families that
have one; ``value``: v_proj output; ``output``: the per-head attention output entering o_proj; ``query``: q_proj
output before RoPE and q_norm; ``input``: the normed hidden state entering the K/V projections, one "head" of the
hidden size) it accumulates a ``RunningGram`` (sum of x x^T
over tokens, the sum of x and the count; every cross-covariance between two heads is a block of it) and,
optionally, a uniform random sample of token rows for the measures that are quadratic in tokens (AsymGQA Eq. 1).
Memory is bounded by the layer widths and the sample size, never by N. The same tokens are sampled for every layer and kind.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dha_train import families
from dha_train.config import ConfigError, TrainLoaderConfig
from dha_train.data.loaders import (
    build_train_dataloader,
    check_data_matches_model,
    closing_batches,
    live_shared_memory,
)
from dha_train.data.tokenizer import load_tokenizer
from dha_train.errors import DhaTrainError
from dha_train.model_folders import check_model_folder, load_source_config
from dha_train.models.head_map import source_head_map
from dha_train.models.llama_layout import attention_modules
from dha_train.ops.similarity import RunningGram

KINDS = ('key', 'value', 'output', 'query', 'input')
_PROJECTION = {'key': 'k_proj', 'value': 'v_proj', 'output': 'o_proj', 'query': 'q_proj', 'input': 'k_proj'}
_FROM_INPUT = ('output', 'input')  # recorded from the projection's input, not its output
CALIBRATION_FILE = 'calibration.pt'


class CalibrationError(DhaTrainError, ValueError):
    """Calibration cannot run as asked (too little data, unknown kinds, a model without a family's attention)."""


@dataclass
class KindStats:
    """One layer's accumulated statistics for one kind."""

    num_heads: int
    running: RunningGram
    sample: torch.Tensor | None = None  # (sampled tokens, heads * head_dim)
    unit: RunningGram | None = None  # the same Gram over rows scaled to unit norm per head (seed 001 Eq. 7-8)

    def unit_gram(self) -> torch.Tensor:
        """Gram of the per-head row-normalised caches, for the cos criterion of the aligned similarity."""
        if self.unit is None:
            raise CalibrationError('no row-normalised Gram was recorded (calibrate with unit_rows=True)')
        return self.unit.gram

    def sample_by_head(self) -> torch.Tensor:
        """The sampled rows as (heads, tokens, head_dim)."""
        if self.sample is None:
            raise CalibrationError('no token sample was recorded (calibrate with sample_tokens > 0)')
        tokens = self.sample.shape[0]
        return self.sample.reshape(tokens, self.num_heads, -1).transpose(0, 1)


@dataclass
class CalibrationStats:
    """What ``calibrate`` returns: stats[layer][kind], plus how they were gathered."""

    stats: list[dict[str, KindStats]]
    tokens: int
    sample_tokens: int
    head_dim: int
    seed: int
    kinds: tuple[str, ...] = field(default=KINDS)

    def layer(self, layer: int, kind: str) -> KindStats:
        if kind not in self.kinds:
            raise CalibrationError(f"kind '{kind}' was not recorded (recorded: {', '.join(self.kinds)})")
        return self.stats[layer][kind]

    @property
    def num_layers(self) -> int:
        return len(self.stats)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({
            'tokens': self.tokens, 'sample_tokens': self.sample_tokens, 'head_dim': self.head_dim,
            'seed': self.seed, 'kinds': list(self.kinds),
            'stats': [{kind: {'num_heads': s.num_heads, 'running': s.running.state_dict(), 'sample': s.sample,
                              'unit': None if s.unit is None else s.unit.state_dict()}
                       for kind, s in layer.items()} for layer in self.stats],
        }, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> 'CalibrationStats':
        data = torch.load(path, map_location='cpu', weights_only=True)
        stats = [{kind: KindStats(s['num_heads'], RunningGram.from_state_dict(s['running']), s['sample'],
                                  RunningGram.from_state_dict(s['unit']) if s.get('unit') is not None else None)
                  for kind, s in layer.items()} for layer in data['stats']]
        return cls(stats, data['tokens'], data['sample_tokens'], data['head_dim'], data['seed'], tuple(data['kinds']))


class _Recorder:
    """Forward hooks that feed each (layer, kind) accumulator with the first ``remaining`` tokens of each batch."""

    def __init__(self, model: torch.nn.Module, kinds: Sequence[str], num_tokens: int, sample_tokens: int, seed: int,
                 unit_rows: bool = False):
        self.attention = attention_modules(model)
        self.head_dim = self.attention[0].head_dim
        self.kinds = tuple(kinds)
        self.remaining = num_tokens
        self.sample_tokens = sample_tokens
        self.generator = torch.Generator().manual_seed(seed)
        self.priorities = torch.empty(0)
        self.keep = 0  # tokens of the current batch that are recorded
        self.sample_index: torch.Tensor | None = None  # rows of cat(old sample, new rows) that stay in the sample
        self.stats: list[dict[str, KindStats]] = []
        for attn in self.attention:
            layer = {}
            for kind in self.kinds:
                projection = getattr(attn, _PROJECTION[kind])
                width = projection.in_features if kind in _FROM_INPUT else projection.out_features
                device = projection.weight.device
                heads = 1 if kind == 'input' else width // self.head_dim
                layer[kind] = KindStats(heads, RunningGram(width, device=device),
                                        unit=RunningGram(width, device=device) if unit_rows else None)
            self.stats.append(layer)
        self.handles: list = []

    def __enter__(self) -> '_Recorder':
        for layer, attn in enumerate(self.attention):
            for kind in self.kinds:
                projection = getattr(attn, _PROJECTION[kind])
                if kind in _FROM_INPUT:
                    hook = projection.register_forward_pre_hook(self._hook(layer, kind, from_input=True))
                else:
                    hook = projection.register_forward_hook(self._hook(layer, kind, from_input=False))
                self.handles.append(hook)
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()

    def begin_batch(self, batch_tokens: int) -> None:
        """Choose which of the batch's tokens are recorded and which enter the sample (bottom-k random priorities:
        the sample stays uniform without replacement over every token recorded so far)."""
        self.keep = min(self.remaining, batch_tokens)
        self.remaining -= self.keep
        if self.sample_tokens == 0:
            return
        candidates = torch.cat([self.priorities, torch.rand(self.keep, generator=self.generator)])
        if candidates.numel() <= self.sample_tokens:
            self.sample_index = torch.arange(candidates.numel())
        else:
            self.sample_index = torch.topk(candidates, self.sample_tokens, largest=False).indices.sort().values
        self.priorities = candidates[self.sample_index]

    def _hook(self, layer: int, kind: str, from_input: bool):
        stats = self.stats[layer][kind]

        def record(module, inputs, output=None):
            rows = (inputs[0] if from_input else output).detach()
            rows = rows.reshape(-1, rows.shape[-1])[:self.keep]
            stats.running.update(rows)
            if stats.unit is not None:
                heads = rows.float().reshape(rows.shape[0], stats.num_heads, -1)
                stats.unit.update((heads / heads.norm(dim=-1, keepdim=True).clamp_min(1e-12)).reshape(rows.shape))
            if self.sample_index is not None:
                kept = rows.float().cpu()
                pool = kept if stats.sample is None else torch.cat([stats.sample, kept])
                stats.sample = pool[self.sample_index]
        return record


def calibrate(model: torch.nn.Module, batches: Iterable[dict], *, num_tokens: int,
              kinds: Sequence[str] = ('key', 'value'), sample_tokens: int = 0, seed: int = 0,
              unit_rows: bool = False) -> CalibrationStats:
    """Run ``model`` (eval mode, no grad) over ``batches`` of ``input_ids`` until ``num_tokens`` tokens are recorded.
    ``unit_rows`` also accumulates the Gram of every head's rows scaled to unit norm (the aligned-GQA cos criterion).

    Raises CalibrationError when the batches run out first. Only the sequences a batch needs are run.
    """
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise CalibrationError(f"calibration kinds must be among {', '.join(KINDS)}, got {list(kinds)}")
    if num_tokens < 1 or sample_tokens < 0:
        raise CalibrationError(f'need num_tokens >= 1 and sample_tokens >= 0, got {num_tokens} and {sample_tokens}')
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    recorder = _Recorder(model, kinds, num_tokens, sample_tokens, seed, unit_rows)
    try:
        with recorder, torch.no_grad():
            for batch in batches:
                if recorder.remaining == 0:
                    break
                input_ids = batch['input_ids']
                rows_needed = -(-recorder.remaining // input_ids.shape[1])
                input_ids = input_ids[:rows_needed].to(device)
                recorder.begin_batch(input_ids.numel())
                model(input_ids=input_ids, use_cache=False)
    finally:
        model.train(was_training)
    if recorder.remaining:
        raise CalibrationError(f'calibration asked for {num_tokens} tokens but the data gave only '
                               f'{num_tokens - recorder.remaining}; lower --tokens or add data')
    return CalibrationStats(recorder.stats, num_tokens, min(sample_tokens, num_tokens), recorder.head_dim, seed,
                            tuple(kinds))


# --- loading a model and its calibration data (shared by `dha-train search` and `dha-train align`) ----------------

DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}


def load_source_model(model_dir: Path, config, *, dtype: str = 'float32', device: str = 'cpu', who: str = 'search'):
    """The plain source model (MHA or GQA, of any family) in ``model_dir`` for calibration, and its head map (``source_head_map``)."""
    check_model_folder(model_dir, who=who)
    source = source_head_map(config, who)
    if dtype not in DTYPES:
        raise ConfigError(f"{who}: dtype must be float32, bfloat16 or float16, got '{dtype}'")
    source_config = load_source_config(model_dir, who=who)
    model = families.of(source_config, who).causal_lm_class.from_pretrained(
        model_dir, config=source_config, local_files_only=True, trust_remote_code=False, torch_dtype=DTYPES[dtype])
    return model.to(device), source


def calibration_batches(model_dir: Path, config, *, data: str, split: str, batch_size: int, seed: int,
                        who: str = 'search'):
    """Batches from a shuffled StreamingDataLoader over the data's domain mixture, checked against the model's
    vocabulary, context length and (when the folder has one) tokenizer."""
    tokenizer = None
    if (model_dir / 'tokenizer.json').is_file() or (model_dir / 'tokenizer_config.json').is_file():
        tokenizer = load_tokenizer(str(model_dir))
    check_data_matches_model(data, vocab_size=config.vocab_size, max_seq_len=config.max_position_embeddings,
                             where=who, tokenizer=tokenizer)
    loader_config = TrainLoaderConfig(root=data, split=split, drop_last=False)
    before = live_shared_memory()
    return closing_batches(build_train_dataloader(loader_config, device_batch_size=batch_size, seed=seed), before)
