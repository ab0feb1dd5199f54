"""Models: HF LLaMA builders and Composer wrappers.

Importing this package registers the DHA model with the transformers Auto classes, so exported DHA folders load
with plain ``AutoModelForCausalLM.from_pretrained(dir)`` (no ``trust_remote_code``).
"""

from dha_train.models.modeling_dha import register_dha_auto_classes

register_dha_auto_classes()
