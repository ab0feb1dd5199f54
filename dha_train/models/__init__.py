"""Models: HF LLaMA builders and Composer wrappers.

Importing this package registers the DHA and MoH models with the transformers Auto classes, so exported folders load
with plain ``AutoModelForCausalLM.from_pretrained(dir)`` (no ``trust_remote_code``).
"""

from dha_train.models.modeling_dha import register_dha_auto_classes
from dha_train.models.modeling_moh import register_moh_auto_classes

register_dha_auto_classes()
register_moh_auto_classes()
