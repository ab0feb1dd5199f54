"""Names -> builders for loggers, callbacks and algorithms, so recipes pick components by name.

A YAML section such as ``callbacks: {speed_monitor: {window_size: 10}}`` becomes
``callbacks.build('speed_monitor', {'window_size': 10})``. Later issues only add entries here (or call
``register`` from their own module in ``algorithms/`` or ``callbacks/``, which train.py imports).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from composer.algorithms import GradientClipping
from composer.callbacks import LRMonitor, MemoryMonitor, OptimizerMonitor, RuntimeEstimator, SpeedMonitor
from composer.loggers import ConsoleLogger, InMemoryLogger, MLFlowLogger, TensorboardLogger, WandBLogger

from dha_train.config import ConfigError, unknown_key_error
from dha_train.errors import DhaTrainError


class Registry:
    def __init__(self, kind: str):
        self.kind = kind
        self._builders: dict[str, Callable[..., Any]] = {}

    def register(self, name: str, builder: Callable[..., Any] | None = None):
        """Register ``builder`` under ``name``; usable as a decorator."""

        def add(fn: Callable[..., Any]):
            if name in self._builders:
                raise ValueError(f'{self.kind} {name!r} is registered twice')
            self._builders[name] = fn
            return fn

        return add(builder) if builder is not None else add

    def names(self) -> list[str]:
        return sorted(self._builders)

    def accepted(self, name: str) -> list[str]:
        """The keyword arguments the component ``name`` takes."""
        parameters = inspect.signature(self._builders[name]).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            raise TypeError(f'{self.kind} {name!r} takes **kwargs; register a class or a function with explicit '
                            'arguments, so a misspelt key is caught')
        return [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    def build(self, name: str, kwargs: dict[str, Any] | None) -> Any:
        """Check ``kwargs`` against the component's signature (unknown or missing keys are a ``ConfigError`` naming
        the closest valid key), then build it; a bad value it refuses becomes a ``ConfigError`` naming it too."""
        if name not in self._builders:
            raise unknown_key_error(self.kind, name, self.names())
        builder, kwargs, where = self._builders[name], dict(kwargs or {}), f'{self.kind}.{name}'
        accepted = self.accepted(name)
        for key in kwargs:
            if key not in accepted:
                raise unknown_key_error(where, key, accepted)
        try:
            inspect.signature(builder).bind(**kwargs)
        except TypeError as exc:
            raise ConfigError(f'{where}: {exc} (accepted: {", ".join(accepted) or "none"})') from exc
        try:
            return builder(**kwargs)
        except (ValueError, TypeError, DhaTrainError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"{where}: {str(exc).removeprefix(f'{name}: ')}") from exc

    def build_all(self, section: dict[str, dict[str, Any]]) -> list[Any]:
        return [self.build(name, kwargs) for name, kwargs in section.items()]


loggers = Registry('loggers')
callbacks = Registry('callbacks')
algorithms = Registry('algorithms')


# --- Composer's own loggers -------------------------------------------------------------------------------------


@loggers.register('console')
def _console_logger(log_interval: str = '10ba', stream: str = 'stdout'):

    return ConsoleLogger(log_interval=log_interval, stream=stream)


@loggers.register('wandb')
def _wandb_logger(project: str | None = None, group: str | None = None, name: str | None = None,
                  entity: str | None = None, tags: list[str] | None = None, log_artifacts: bool = False,
                  mode: str = 'online', dir: str | None = None):
    """W&B; ``mode: offline`` writes a run folder under ``dir`` that `wandb sync` uploads later."""

    if mode not in ('online', 'offline', 'disabled'):
        raise ConfigError(f"loggers.wandb.mode: '{mode}' is not one of online, offline, disabled")
    init_kwargs: dict[str, Any] = {'mode': mode}
    if dir is not None:
        init_kwargs['dir'] = dir
    return WandBLogger(project=project, group=group, name=name, entity=entity, tags=tags,
                       log_artifacts=log_artifacts, init_kwargs=init_kwargs)


@loggers.register('tensorboard')
def _tensorboard_logger(log_dir: str | None = None, flush_interval: int = 100):
    """Needs the optional `dashboards` extra (tensorboard)."""

    return TensorboardLogger(log_dir=log_dir, flush_interval=flush_interval)


@loggers.register('mlflow')
def _mlflow_logger(experiment_name: str | None = None, run_name: str | None = None,
                   tracking_uri: str | None = None, tags: dict[str, Any] | None = None):
    """Needs the optional `dashboards` extra (mlflow). A local ``tracking_uri`` (file:/path) works offline."""

    return MLFlowLogger(experiment_name=experiment_name, run_name=run_name, tracking_uri=tracking_uri, tags=tags)


@loggers.register('in_memory')
def _in_memory_logger():

    return InMemoryLogger()


# --- Composer's own callbacks -----------------------------------------------------------------------------------


@callbacks.register('speed_monitor')
def _speed_monitor(window_size: int = 100, gpu_flops_available: float | None = None):

    return SpeedMonitor(window_size=window_size, gpu_flops_available=gpu_flops_available)


@callbacks.register('lr_monitor')
def _lr_monitor():

    return LRMonitor()


@callbacks.register('memory_monitor')
def _memory_monitor():
    """Reports GPU memory; on CPU Composer warns once and logs nothing."""

    return MemoryMonitor()


@callbacks.register('runtime_estimator')
def _runtime_estimator(skip_batches: int = 1, time_unit: str = 'hours'):

    return RuntimeEstimator(skip_batches=skip_batches, time_unit=time_unit)


@callbacks.register('optimizer_monitor')
def _optimizer_monitor(log_optimizer_metrics: bool = True):

    return OptimizerMonitor(log_optimizer_metrics=log_optimizer_metrics)


# --- Composer's own algorithms ----------------------------------------------------------------------------------
@algorithms.register('gradient_clipping')
def _gradient_clipping(clipping_type: str = 'norm', clipping_threshold: float = 1.0):

    if clipping_type not in ('norm', 'value', 'adaptive'):
        raise ConfigError(f"algorithms.gradient_clipping.clipping_type: '{clipping_type}' is not one of norm, value, "
                          'adaptive')
    return GradientClipping(clipping_type=clipping_type, clipping_threshold=clipping_threshold)
