"""dha_train's own Composer callbacks; each registers itself in dha_train.registry.callbacks."""

from dha_train.callbacks.fusion_monitor import FusionMonitor
from dha_train.callbacks.head_search import HeadSearch
from dha_train.callbacks.lm_eval_at_end import LmEvalAtEnd
from dha_train.callbacks.moh_monitor import MohMonitor
from dha_train.callbacks.throughput_probe import ThroughputProbe

__all__ = ['FusionMonitor', 'HeadSearch', 'LmEvalAtEnd', 'MohMonitor', 'ThroughputProbe']
