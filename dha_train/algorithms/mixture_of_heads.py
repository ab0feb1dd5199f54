"""``MixtureOfHeads``: MoH attention (seed 002) as a Composer algorithm.

- ``Event.INIT`` (before FSDP wrapping): every attention of the source family (``dha_train.families``: LLaMA,
  Mistral, Qwen2, Qwen3, Gemma 3) becomes a ``MohLlamaAttention`` of that family that keeps the layer's modules (q/k/v/o
  projections with their biases, q/k norms) and its scale and sliding window, so a pretrained model starts where it
  was. ``router: query_norm`` (the default)
  is the paper's continue-tuning router (no parameters; 0/1 gates with straight-through gradients); ``learned`` adds
  one router per layer, seeded from the run seed, in its own parameter group (``router_lr``), for training from
  scratch. The settings are written into the model config, so the checkpoint exports as the MoH model class.
- ``Event.AFTER_LOSS``: adds ``balance_weight`` times the load-balance loss (Eq. 7) summed over layers. Each layer
  keeps the value of its last forward only, and the algorithm takes it once per micro-batch and clears it, so
  activation checkpointing (whose recompute only overwrites it) cannot count it twice. Composer then scales the
  micro-batch loss by its share of the batch, so over gradient accumulation the added term is the mean of the
  micro-batch values, whatever the number of micro-batches.
- ``Event.BATCH_END``: ``moh/balance_loss`` (that mean, before ``balance_weight``) and the routing statistics
  (``routing``), which ``moh_monitor`` logs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from composer.core import Algorithm, Event, State
from composer.loggers import Logger
from torch import nn

from dha_train import families, registry
from dha_train.config import ConfigError
from dha_train.methods import tag_method
from dha_train.models.llama_layout import hf_model
from dha_train.models.modeling_moh import ROUTERS, MohLlamaAttention, check_moh_settings
from dha_train.optim import add_param_group

ROUTER_GROUP = 'moh_router'
SETTINGS = ('router', 'shared_heads', 'top_k')


def _plain(value):
    return list(value) if isinstance(value, Sequence) and not isinstance(value, str) else value


class MixtureOfHeads(Algorithm):
    def __init__(self, router: str = 'query_norm', shared_heads=None, top_k=None, balance_weight: float = 0.01,
                 router_lr: Optional[float] = None):
        if router not in ROUTERS:
            raise ValueError(f"mixture_of_heads: router must be one of {', '.join(ROUTERS)}, got {router!r}")
        if balance_weight < 0:
            raise ValueError(f'mixture_of_heads: balance_weight must be >= 0, got {balance_weight}')
        if router_lr is not None and (router != 'learned' or router_lr <= 0):
            raise ValueError('mixture_of_heads: router_lr is for the learned router and must be > 0')
        # Plain ints or lists (not omegaconf containers): they go into the model config and the checkpoint.
        self.router = router
        self.shared_heads, self.top_k = _plain(shared_heads), _plain(top_k)
        self.balance_weight, self.router_lr = balance_weight, router_lr
        self.attentions: list[MohLlamaAttention] = []
        self.routing: dict[str, torch.Tensor] = {}  # the last batch's statistics, mean over its micro-batches
        self._sums: dict[str, torch.Tensor] = {}
        self._microbatches = 0

    @staticmethod
    def of(state: State, needed_by: str) -> 'MixtureOfHeads':
        """The run's MixtureOfHeads algorithm, for the callbacks that read it."""
        for algorithm in state.algorithms:
            if isinstance(algorithm, MixtureOfHeads):
                return algorithm
        raise ConfigError(f'{needed_by} needs the mixture_of_heads algorithm in the recipe '
                         '(algorithms: mixture_of_heads: ...)')

    def apply_surgery(self, model: nn.Module, seed: int = 0) -> list[nn.Parameter]:
        """Swap every attention for MoH attention; returns the routers it created (none for query_norm, nor for a
        MoH checkpoint, whose routers the optimizer already holds)."""
        hf = hf_model(model)
        config = hf.config
        family = families.check('moh', config, 'mixture_of_heads')
        heads, layers = config.num_attention_heads, config.num_hidden_layers
        shared = heads // 2 if self.shared_heads is None else self.shared_heads
        top_k = heads // 4 if self.top_k is None else self.top_k
        check_moh_settings(heads, layers, shared, top_k, self.router)
        if getattr(config, 'moh_router', None) is not None:  # already a MoH checkpoint: it must agree
            saved = (config.moh_router, config.moh_shared_heads, config.moh_top_k)
            if saved != (self.router, shared, top_k):
                raise ConfigError(f'mixture_of_heads: the model is already MoH with router, shared_heads, top_k = '
                                 f'{saved}; the recipe asks for {(self.router, shared, top_k)}')
        config.moh_router, config.moh_shared_heads, config.moh_top_k = self.router, shared, top_k
        tag_method(config, 'moh')  # the checkpoint exports as the MoH model class (dha_train.methods)

        generator = torch.Generator().manual_seed(seed)
        routers = []
        self.attentions = []
        for parent in hf.model.layers:
            attn = parent.self_attn
            if not isinstance(attn, MohLlamaAttention):
                if type(attn) is not family.classes.attention:
                    raise ConfigError(f'mixture_of_heads: MoH surgery takes {family.label} attention '
                                      f'({family.classes.attention.__name__}, MHA or GQA), not {type(attn).__name__}')
                weight = attn.q_proj.weight
                moh = MohLlamaAttention.from_attention(attn, config)
                if moh.router is not None:
                    init = torch.empty(moh.router.out_features, moh.router.in_features)
                    init.normal_(0.0, config.initializer_range, generator=generator)
                    moh.router = nn.Linear(moh.router.in_features, moh.router.out_features, bias=False)
                    moh.router.weight = nn.Parameter(init.to(device=weight.device, dtype=weight.dtype))
                    routers.append(moh.router.weight)
                parent.self_attn = attn = moh
            self.attentions.append(attn)
        return routers

    def match(self, event: Event, state: State) -> bool:
        return event in (Event.INIT, Event.AFTER_LOSS, Event.BATCH_END)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.INIT:
            routers = self.apply_surgery(state.model, seed=state.rank_zero_seed)
            if routers:
                options = {} if self.router_lr is None else {'lr': self.router_lr}
                for optimizer in state.optimizers:
                    add_param_group(optimizer, ROUTER_GROUP, routers, weight_decay=0.0, **options)
        elif event == Event.AFTER_LOSS:
            balance = self.take_balance_loss()
            if balance is not None and self.balance_weight:
                state.loss = state.loss + self.balance_weight * balance
        elif event == Event.BATCH_END:
            self._batch_end(logger)

    def take_balance_loss(self) -> Optional[torch.Tensor]:
        """The last forward's load-balance loss summed over layers (None when no layer routes), and its routing
        statistics added to the batch's running sums; each layer's values are cleared, so they count once."""
        stats = [attn.routing_stats for attn in self.attentions]
        if any(s is None for s in stats):
            raise RuntimeError('mixture_of_heads: a layer has no routing statistics; did the forward pass run?')
        losses = [attn.balance_loss for attn in self.attentions if attn.balance_loss is not None]
        balance = torch.stack(losses).sum() if losses else None
        with torch.no_grad():
            current = {'load': torch.stack([s['load'] for s in stats])}  # (layers, heads)
            for key in ('router_entropy', 'router_max_prob', 'alpha_shared'):
                values = [s[key] for s in stats if key in s]
                if values:
                    current[key] = torch.stack(values)
            if balance is not None:
                current['balance_loss'] = balance.detach()
            for key, value in current.items():
                self._sums[key] = self._sums[key] + value if key in self._sums else value.clone()
        self._microbatches += 1
        for attn in self.attentions:
            attn.balance_loss, attn.routing_stats = None, None
        return balance

    def _batch_end(self, logger: Logger) -> None:
        if not self._microbatches:
            return
        # One host sync per batch: the sums stayed on the device through the micro-batches.
        self.routing = {key: (value / self._microbatches).cpu() for key, value in self._sums.items()}
        self._sums, self._microbatches = {}, 0
        if 'balance_loss' in self.routing:
            logger.log_metrics({'moh/balance_loss': float(self.routing['balance_loss'])})

    def state_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in SETTINGS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = {key: state.get(key) for key in SETTINGS}
        mine = {key: getattr(self, key) for key in SETTINGS}
        if saved != mine:
            raise ConfigError(f'mixture_of_heads: the checkpoint was trained with {saved}, the recipe asks for {mine}')


registry.algorithms.register('mixture_of_heads', MixtureOfHeads)
