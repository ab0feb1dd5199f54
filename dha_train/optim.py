"""Optimizer, parameter groups and lr schedule of a run (DecoupledAdamW, cosine with warm-up)."""

from __future__ import annotations

from composer.optim import CosineAnnealingWithWarmupScheduler, DecoupledAdamW

from dha_train.config import ConfigError, OptimizerConfig, SchedulerConfig


def named_param_groups(model, optimizer_cfg: OptimizerConfig) -> list[dict]:
    """Split parameters into named groups, so logs and later algorithms can address a group by name."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        lowered = name.lower()
        is_no_decay = param.ndim < 2 or any(p in lowered for p in optimizer_cfg.no_decay_name_patterns)
        (no_decay if is_no_decay else decay).append(param)
    groups = [{'name': 'decay', 'params': decay}]
    if no_decay:
        groups.append({'name': 'no_decay', 'params': no_decay, 'weight_decay': 0.0})
    return groups


def add_param_group(optimizer, name: str, params, **options) -> None:
    """Give new parameters (fusion weights, masks, routers) their own named group and learning rate.

    Call at ``Event.INIT``: Composer compiles the lr schedule after INIT, so the schedule scales this group too,
    and its FSDP2 path re-syncs the optimizer with the sharded parameters after wrapping.
    """
    existing = [g.get('name') for g in optimizer.param_groups]
    if name in existing:
        raise ValueError(f'optimizer already has a parameter group named {name!r} (groups: {existing})')
    optimizer.add_param_group({'name': name, 'params': list(params), **options})


def build_optimizer(model, cfg: OptimizerConfig) -> DecoupledAdamW:
    if cfg.name != 'decoupled_adamw':
        raise ConfigError(f"optimizer.name: '{cfg.name}' is not supported (supported: decoupled_adamw)")
    return DecoupledAdamW(named_param_groups(model, cfg), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                          weight_decay=cfg.weight_decay)


def build_scheduler(cfg: SchedulerConfig) -> CosineAnnealingWithWarmupScheduler:
    if cfg.name != 'cosine_with_warmup':
        raise ConfigError(f"scheduler.name: '{cfg.name}' is not supported (supported: cosine_with_warmup)")
    return CosineAnnealingWithWarmupScheduler(t_warmup=cfg.t_warmup, alpha_f=cfg.alpha_f)
