"""transformers' classes of each source family, by ``model_type``: the one table of them.

The family layer (``dha_train.families``) takes its classes from here, and the project's own modeling files
(DHA, MoH, MLA), which stay self-contained so that they can be copied next to exported weights, build their
decoder from the source family's classes found here. A ``source_model_type`` read from a config is only ever a key
of this table (``family_classes``): nothing named by data is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers.models.gemma3 import modeling_gemma3
from transformers.models.gemma3.configuration_gemma3 import Gemma3TextConfig
from transformers.models.llama import modeling_llama
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.mistral import modeling_mistral
from transformers.models.mistral.configuration_mistral import MistralConfig
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen2.configuration_qwen2 import Qwen2Config
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config


@dataclass(frozen=True)
class FamilyClasses:
    config: type
    causal_lm: type
    model: type  # the decoder stack (embeddings, layers, final norm, rotary embeddings)
    pretrained: type
    decoder_layer: type
    attention: type
    rotary: type
    norm: type


def _classes(config, module, prefix: str, causal_lm: str = 'ForCausalLM', model: str = 'Model') -> FamilyClasses:
    return FamilyClasses(config=config, causal_lm=getattr(module, prefix + causal_lm),
                         model=getattr(module, prefix + model), pretrained=getattr(module, prefix + 'PreTrainedModel'),
                         decoder_layer=getattr(module, prefix + 'DecoderLayer'),
                         attention=getattr(module, prefix + 'Attention'),
                         rotary=getattr(module, prefix + 'RotaryEmbedding'), norm=getattr(module, prefix + 'RMSNorm'))


FAMILY_CLASSES: dict[str, FamilyClasses] = {
    'llama': _classes(LlamaConfig, modeling_llama, 'Llama'),
    'mistral': _classes(MistralConfig, modeling_mistral, 'Mistral'),
    'qwen2': _classes(Qwen2Config, modeling_qwen2, 'Qwen2'),
    'qwen3': _classes(Qwen3Config, modeling_qwen3, 'Qwen3'),
    'gemma3_text': _classes(Gemma3TextConfig, modeling_gemma3, 'Gemma3', model='TextModel'),
}
DEFAULT_SOURCE = 'llama'  # the family of the project's own classes written before the family layer


def family_classes(source_model_type: str | None) -> FamilyClasses:
    """The classes of a source family; a ``source_model_type`` outside the table is refused, never imported."""
    key = source_model_type or DEFAULT_SOURCE
    if key not in FAMILY_CLASSES:
        raise ValueError(f"source_model_type {key!s:.40} is not one of {', '.join(FAMILY_CLASSES)}")
    return FAMILY_CLASSES[key]
