"""dha_train's own Composer callbacks; each registers itself in dha_train.registry.callbacks."""

from dha_train.callbacks.throughput_probe import ThroughputProbe

__all__ = ['ThroughputProbe']
