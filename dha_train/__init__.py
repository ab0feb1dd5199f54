"""dha_train: convert multi-head-attention LLaMA checkpoints into cheaper attention and train them back."""

__version__ = '0.1.0'
