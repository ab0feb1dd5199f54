"""The family layer: one module per HF architecture family, registered by ``model_type``.

Every conversion, healing step, export, the engine and the plan ask it for architecture facts (``of(config)``) and
whether a method can carry this checkpoint's features (``check``). A new family is one module here plus its row in
the support matrix test (tests/test_families.py); docs/families.md is the matrix.

The project's own attention classes (``dha_llama``, ``moh_llama``, ``mla_llama``) replace only the attention module
inside their source family's decoder; their config names that family in ``source_model_type`` (absent: ``llama``,
the only family before the family layer).
"""

from __future__ import annotations

from dha_train.families import gemma3, llama, mistral, qwen2, qwen3
from dha_train.families.base import COMMANDS, METHODS, PROJECTIONS, Family, FamilyError, head_dim

__all__ = ['COMMANDS', 'FAMILIES', 'METHODS', 'PROJECTIONS', 'Family', 'FamilyError', 'OWN_MODEL_TYPES',
           'SOURCE_MODEL_TYPE', 'LLAMA_CPP_ARCHS', 'by_llama_cpp_arch', 'check', 'get', 'head_dim', 'of',
           'source_model_type', 'supported']

FAMILIES: dict[str, Family] = {family.model_type: family for family in
                               (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma3.FAMILY)}
SOURCE_MODEL_TYPE = 'source_model_type'  # config attribute of the project's own classes: their source family
OWN_MODEL_TYPES = ('dha_llama', 'moh_llama', 'mla_llama')
# llama.cpp's architectures of the families' GGUF files (Mistral's are 'llama')
LLAMA_CPP_ARCHS = tuple(dict.fromkeys(family.llama_cpp_arch for family in FAMILIES.values()))


def by_llama_cpp_arch(architecture: str) -> Family | None:
    """The family a GGUF of llama.cpp's ``architecture`` is imported as (the first registered: a 'llama' file is
    LLaMA, as llama.cpp runs it), or None."""
    return next((family for family in FAMILIES.values() if family.llama_cpp_arch == architecture), None)


def supported() -> tuple[str, ...]:
    return tuple(FAMILIES)


def get(model_type: str, who: str = 'dha-train') -> Family:
    if model_type not in FAMILIES:
        raise FamilyError(f"{who}: model type {model_type!s:.40} is not a family dha-train supports "
                          f"(supported: {', '.join(FAMILIES)})")
    return FAMILIES[model_type]


def source_model_type(config) -> str:
    """The family a config's model is built on: its own ``model_type``, or for the project's own classes the
    family recorded in ``source_model_type``."""
    model_type = getattr(config, 'model_type', None)
    if model_type in OWN_MODEL_TYPES:
        return getattr(config, SOURCE_MODEL_TYPE, None) or 'llama'
    return model_type


def of(config, who: str = 'dha-train') -> Family:
    """The family of a source config, or of a project class's source."""
    return get(source_model_type(config), who)


def check(method: str, config, who: str) -> Family:
    """The config's family, after refusing in one line a family or a feature of it that ``method`` cannot carry."""
    family = of(config, who)
    family.check(method, config, who)
    return family
