"""dha_train's Composer algorithms; each registers itself in dha_train.registry.algorithms."""

from dha_train.algorithms.distillation import Distillation
from dha_train.algorithms.head_fusion import HeadFusion
from dha_train.algorithms.kv_head_transfer import KVHeadTransfer
from dha_train.algorithms.mixture_of_heads import MixtureOfHeads

__all__ = ['Distillation', 'HeadFusion', 'KVHeadTransfer', 'MixtureOfHeads']
