"""dha_train's Composer algorithms; each registers itself in dha_train.registry.algorithms."""

from dha_train.algorithms.head_fusion import HeadFusion

__all__ = ['HeadFusion']
