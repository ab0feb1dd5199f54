"""What a family module states: one HF architecture's attention facts, its classes, its llama.cpp name, and which
conversions its maths allows.

A ``Family`` is a frozen value; each family module (``llama.py``, ``qwen2.py``, ...) builds one and the package
registers it by ``model_type``. Facts that depend on a checkpoint (whether a Qwen2 folder uses sliding windows, a
LLaMA-3.x RoPE scaling) are functions of its config, so a method is refused only for the features a model has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dha_train.errors import DhaTrainError
from dha_train.models.family_classes import FamilyClasses

PROJECTIONS = ('q_proj', 'k_proj', 'v_proj', 'o_proj')

# Every conversion and command a family is asked about (the support matrix's columns, docs/families.md).
METHODS = ('mean_pool', 'asym_gqa', 'dha', 'aligned_gqa', 'moh', 'mla', 'mla_deepseek')
COMMANDS = ('refit', 'attention_transfer', 'eval', 'export', 'export_gguf', 'import_gguf', 'plan')


class FamilyError(DhaTrainError, ValueError):
    """A model family the project does not support, or a family feature a method cannot carry."""


@dataclass(frozen=True)
class Feature:
    """A property of a model's attention that some methods cannot carry: ``present(config)`` says whether this
    checkpoint has it; ``always`` features are in every checkpoint of the family (Qwen3's q/k norms), so a method
    that cannot carry one refuses the whole family."""
    name: str
    present: Callable[[object], bool]
    always: bool = False


def always(name: str) -> Feature:
    return Feature(name, lambda config: True, always=True)


# HF decoder-layer norms -> llama.cpp's tensor names (LLaMA's two norms a layer)
LLAMA_NORMS = (('input_layernorm', 'attn_norm'), ('post_attention_layernorm', 'ffn_norm'))


@dataclass(frozen=True)
class LlamaCppLayout:
    """How the family's llama.cpp architecture reads a GGUF file (``dha_train.gguf_export`` writes it so), as the
    llama.cpp vendored in llama-cpp-python 0.3.36 loads it (``src/models/<arch>.cpp``, ``llama_model_rope_type``)."""
    # NORM RoPE (llama, deci: adjacent pairs) needs HF's half-split Q/K rows reordered; NEOX (qwen2, qwen3, gemma3)
    # rotates the halves as HF does
    rope_pairs_adjacent: bool = True
    # the architecture that takes a different K/V head count per layer, or None when the family's has none
    per_layer_arch: str | None = None
    # (HF name under model.layers.N, GGUF name under blk.N) of every norm of a layer, ``.weight`` left off
    norms: tuple[tuple[str, str], ...] = LLAMA_NORMS
    norm_offset: float = 0.0  # what the HF norm adds to its weight (Gemma's 1 + w); the file holds w + offset
    biases: tuple[str, ...] = PROJECTIONS  # projections whose bias the architecture loads
    rope_freqs: bool = True  # loads a ``rope_freqs`` tensor (LLaMA-3.x's 'llama3' RoPE scaling)
    # reads a window, a per-layer sliding-window pattern and the sliding layers' RoPE theta (given by this)
    sliding_rope_theta: Callable[[object], float] | None = None
    # the softmax scale the engine applies whatever the file says, when it has a fixed one (gemma3); the exporter
    # folds the ratio to the family's ``attention_scale`` into attn_q_norm (Q is normed, rotated, then scaled)
    engine_attention_scale: Callable[[object], float] | None = None


@dataclass(frozen=True)
class Family:
    model_type: str
    label: str  # for people: 'Qwen2 / Qwen2.5'
    classes: FamilyClasses  # transformers' classes (dha_train.models.family_classes)
    llama_cpp_arch: str  # general.architecture of its GGUF files
    # which of q/k/v/o_proj carry a bias in this checkpoint
    biased_projections: Callable[[object], tuple[str, ...]]
    qk_norm: bool = False  # per-head RMSNorm on queries and keys (over head_dim, shared by every head)
    # per layer, the sliding window (tokens) or None for full attention
    sliding_windows: Callable[[object], list[int | None]] = lambda config: [None] * config.num_hidden_layers
    attention_scale: Callable[[object], float] = lambda config: _head_dim(config) ** -0.5
    features: tuple[Feature, ...] = ()
    # method or command -> {feature name: why it cannot carry it}; a method absent here carries every feature
    refusals: dict[str, dict[str, str]] = field(default_factory=dict)
    llama_cpp: LlamaCppLayout = LlamaCppLayout()  # how its llama.cpp architecture reads a GGUF
    # (config as transformers read it from a GGUF, the header's architecture keys without the 'arch.' prefix) ->
    # {setting: (value, why)}: what llama.cpp reads that transformers' GGUF mapping leaves out (import-gguf)
    gguf_config: Callable[[object, dict], dict] = lambda config, header: {}

    @property
    def config_class(self) -> type:
        return self.classes.config

    @property
    def causal_lm_class(self) -> type:
        return self.classes.causal_lm

    def present_features(self, config) -> list[str]:
        return [feature.name for feature in self.features if feature.present(config)]

    def refusal(self, method: str, config=None) -> str | None:
        """Why ``method`` cannot convert this family (or this checkpoint, given its config), or None when it can.
        Without a config, every feature the family can have counts."""
        if method not in METHODS + COMMANDS:
            raise ValueError(f'{method!r} is neither a method nor a command the family layer knows')
        reasons = self.refusals.get(method, {})
        for feature in self.features:
            if feature.name in reasons and (config is None or feature.present(config)):
                return f'{method} cannot carry {self.label} {feature.name}: {reasons[feature.name]}'
        if '*' in reasons:
            return f'{method} does not take {self.label} models: {reasons["*"]}'
        return None

    def check(self, method: str, config, who: str) -> None:
        reason = self.refusal(method, config)
        if reason is not None:
            raise FamilyError(f'{who}: {reason}')


def _head_dim(config) -> int:
    return getattr(config, 'head_dim', None) or config.hidden_size // config.num_attention_heads


def head_dim(config) -> int:
    """Per-head width: the config's ``head_dim`` when it sets one, else hidden_size / num_attention_heads."""
    return _head_dim(config)


def windows_by_layer_types(config) -> list[int | None]:
    """transformers' ``layer_types`` (4.53: Qwen2, Qwen3, Gemma 3): a window on each 'sliding_attention' layer."""
    types = getattr(config, 'layer_types', None) or ['full_attention'] * config.num_hidden_layers
    return [config.sliding_window if kind == 'sliding_attention' else None for kind in types]


def has_sliding_window_layers(config) -> bool:
    return any(window is not None for window in windows_by_layer_types(config))


def rope_type(config) -> str:
    scaling = getattr(config, 'rope_scaling', None) or {}
    return scaling.get('rope_type', scaling.get('type', 'default'))


def biased(config) -> bool:
    return bool(getattr(config, 'attention_bias', False))


def all_or_none_biases(config) -> tuple[str, ...]:
    """LLaMA, Qwen3, Gemma 3: one ``attention_bias`` switch for all four projections."""
    return PROJECTIONS if biased(config) else ()


# Features several families share, named alike so that the support matrix reads the same across families.
ATTENTION_BIAS = Feature('attention biases', biased)
QK_NORM = always('per-head q/k norms')
SLIDING_WINDOW_LAYERS = Feature('sliding-window layers', has_sliding_window_layers)


def per_layer_kv_heads(config) -> bool:
    """A DHA/AsymGQA config whose layers keep different K/V head counts."""
    head_map = getattr(config, 'head_map', None)
    if not head_map:
        return False
    return len({len(set(layer['key'])) for layer in head_map['layers']}) > 1


PER_LAYER_KV_HEADS = Feature('per-layer K/V head counts', per_layer_kv_heads)
