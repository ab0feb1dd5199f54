"""dha_train: convert multi-head-attention LLaMA checkpoints into cheaper attention and train them back."""

import os

# Recipes take local paths; nothing may reach a model hub at run time. Set here, before any submodule imports
# transformers or huggingface_hub (they read these once, at import).
os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TRANSFORMERS_OFFLINE', '1')

__version__ = '0.1.0'
