"""The three readings of a GGUF file behind ``dha_train.gguf_import``, each as llama.cpp reads the same file: the
config (transformers' mapping, then the values it leaves out), the weights (transformers' GGUF loader), and the
tokenizer (transformers' converter, or this module's where that converter builds another model than llama.cpp runs).
``gguf_import``'s docstring says what is corrected and why; every correction is returned, to be recorded.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig

from dha_train.errors import DhaTrainError

# llama.cpp's token types (gguf.TokenType): NORMAL pieces merge, CONTROL are special, USER_DEFINED split off first
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
# config.to_dict() keys that are not settings of the model
_NOT_SETTINGS = ('model_type', 'architectures', 'transformers_version', '_model_name_or_path', '_name_or_path')


class GgufError(DhaTrainError):
    """A file that is not a GGUF, or a GGUF this command cannot import (an architecture of no supported family, or
    a setting it cannot carry)."""


def transformers_reads(architecture: str) -> bool:
    """Whether transformers' GGUF loader knows the architecture (4.53: llama, qwen2, gemma3; not qwen3)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return architecture in GGUF_SUPPORTED_ARCHITECTURES


# ---- the config ------------------------------------------------------------------------------------------------


def gguf_config(alone: Path, header: dict, family) -> tuple[object, dict]:
    """The family's config for the GGUF ``alone`` (its link from ``gguf_alone``) and the corrections made to
    transformers' reading of it: setting -> {'was', 'now', 'why'}."""
    corrections: dict[str, dict] = {}
    if transformers_reads(header['architecture']):
        loaded = AutoConfig.from_pretrained(str(alone.parent), gguf_file=str(alone), local_files_only=True)
        values = {key: value for key, value in loaded.to_dict().items() if key not in _NOT_SETTINGS}
        if loaded.model_type != family.model_type:
            # transformers reads a 'llama' file whose general.name is "mistral" as Mistral, with Mistral's default
            # sliding window; llama.cpp's 'llama' architecture has none
            corrections['model_type'] = {'was': loaded.model_type, 'now': family.model_type,
                                         'why': f"llama.cpp runs a '{header['architecture']}' file as "
                                                f'{family.label}, whatever its general.name says'}
            settings = family.config_class().to_dict()
            values = {key: value for key, value in values.items() if key in settings}
    else:
        values = _header_settings(header)
        corrections['config'] = {'was': None, 'now': 'read from the header by dha_train',
                                 'why': f"transformers' GGUF loader has no '{header['architecture']}' architecture"}
    config = family.config_class(**values)

    fixes = _rope_settings(config, header, family)
    fixes.update(family.gguf_config(config, header['arch']))
    for key, (value, why) in fixes.items():
        was = getattr(config, key, None)
        if was != value:
            corrections[key] = {'was': was, 'now': value, 'why': why}
    if fixes:
        config = family.config_class(**{**_settings(config), **{key: value for key, (value, _) in fixes.items()}})
    return config, corrections


def _settings(config) -> dict:
    return {key: value for key, value in config.to_dict().items() if key not in _NOT_SETTINGS}


def _header_settings(header: dict) -> dict:
    """What llama.cpp's loader reads from any of the attention architectures here, as HF config settings."""
    arch, special = header['arch'], header['special_token_ids']
    heads = arch['attention.head_count']
    kv_heads = arch.get('attention.head_count_kv', heads)
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        raise GgufError(f"import-gguf: the file's head counts differ between layers, which a "
                        f"'{header['architecture']}' model cannot hold")
    values = {
        'vocab_size': arch.get('vocab_size') or header['token_count'],
        'hidden_size': arch['embedding_length'], 'intermediate_size': arch['feed_forward_length'],
        'num_hidden_layers': arch['block_count'], 'num_attention_heads': heads, 'num_key_value_heads': kv_heads,
        'max_position_embeddings': arch['context_length'], 'rms_norm_eps': arch['attention.layer_norm_rms_epsilon'],
        'rope_theta': arch.get('rope.freq_base', 10000.0), 'tie_word_embeddings': header['tied_embeddings'],
        'bos_token_id': special.get('bos_token'), 'eos_token_id': special.get('eos_token'),
        'pad_token_id': special.get('pad_token'),
    }
    if arch.get('attention.key_length'):
        values['head_dim'] = arch['attention.key_length']
    return values


def _rope_settings(config, header: dict, family) -> dict:
    """RoPE scaling llama.cpp applies and transformers' mapping drops: ``rope.scaling.type`` linear, and LLaMA-3.x's
    ``llama3`` scaling, which a file holds as the ``rope_freqs`` tensor (per frequency: default / scaled)."""
    arch = header['arch']
    kind = arch.get('rope.scaling.type')
    if kind == 'linear':
        return {'rope_scaling': ({'rope_type': 'linear', 'factor': float(arch['rope.scaling.factor'])},
                                 "llama.cpp divides positions by the file's rope.scaling.factor")}
    if kind not in (None, 'none'):
        raise GgufError(f"import-gguf: the file's RoPE scaling {str(kind)!r:.20} is not one import-gguf carries "
                        '(linear, and llama3 as a rope_freqs tensor)')
    factors = header['rope_freqs']
    if factors is None:
        return {}
    if not family.llama_cpp.rope_freqs:
        raise GgufError(f"import-gguf: the file holds a rope_freqs tensor, which llama.cpp's "
                        f"'{header['architecture']}' architecture does not read")
    scaling = _llama3_scaling(config, np.asarray(factors, dtype=np.float64).reshape(-1))
    if scaling is None:
        raise GgufError("import-gguf: the file's rope_freqs tensor matches no LLaMA-3.x 'llama3' RoPE scaling "
                        '(low_freq_factor 1, high_freq_factor 4); transformers would drop it and compute other logits')
    return {'rope_scaling': (scaling, "the file's rope_freqs tensor is LLaMA-3.x's llama3 scaling, which "
                                      "transformers' GGUF loader drops")}


def _llama3_scaling(config, factors: np.ndarray) -> dict | None:
    """The ``llama3`` rope_scaling whose frequencies (transformers' own initialiser) divide the default ones by
    ``factors``: the factor is the largest ratio; low/high frequency factors 1 and 4 (every LLaMA-3.x); the original
    context 8192 (every LLaMA-3.x) or the context over the factor."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    factor = float(factors.max())
    trial = copy.deepcopy(config)
    trial.rope_scaling = None
    default, _ = ROPE_INIT_FUNCTIONS['default'](trial, 'cpu')
    if default.numel() != factors.size or factor <= 1.0:
        return None
    for original in dict.fromkeys((8192, round(config.max_position_embeddings / factor))):
        trial.rope_scaling = {'rope_type': 'llama3', 'factor': factor, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                              'original_max_position_embeddings': int(original)}
        scaled, _ = ROPE_INIT_FUNCTIONS['llama3'](trial, 'cpu')
        if np.allclose((default / scaled).double().numpy(), factors, rtol=1e-5, atol=0):
            return trial.rope_scaling
    return None


# ---- the weights -----------------------------------------------------------------------------------------------


def gguf_model(alone: Path, config, family):
    """The model of the GGUF ``alone`` in float32: transformers' GGUF loader where it knows the architecture (it
    reverses llama.cpp's Q/K row order for ``llama`` and subtracts Gemma's norm offset); else its tensor-name map
    and gguf's de-quantiser (the architectures it lacks here, ``qwen3``, rotate the halves as HF does and hold their
    norms as HF does)."""
    if transformers_reads(family.llama_cpp_arch):
        return family.causal_lm_class.from_pretrained(str(alone.parent), gguf_file=str(alone), config=config,
                                                      torch_dtype=torch.float32, local_files_only=True,
                                                      trust_remote_code=False)
    import gguf
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map
    from transformers.modeling_utils import no_init_weights

    with no_init_weights():
        model = family.causal_lm_class(config)
    names = get_gguf_hf_weights_map(model)
    offset = family.llama_cpp.norm_offset
    state = {}
    for tensor in gguf.GGUFReader(alone).tensors:
        if tensor.name in names:
            weights = gguf.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            if offset and tensor.name.endswith('norm.weight'):
                weights = weights - offset
            state[names[tensor.name]] = torch.from_numpy(np.ascontiguousarray(weights))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [name for name in missing if not (name == 'lm_head.weight' and config.tie_word_embeddings)]
    if missing or unexpected:
        raise GgufError(f"import-gguf: the file's tensors do not fill a {family.label} model: missing "
                        f"{', '.join(missing[:3]) or 'none'}; unexpected {', '.join(unexpected[:3]) or 'none'}")
    model.tie_weights()
    return model.float().eval()


# ---- the tokenizer ---------------------------------------------------------------------------------------------


def gguf_tokenizer(path: Path, header: dict, family, load_gguf_tokenizer, read_as: str) -> tuple[object, dict | None]:
    """The GGUF's tokenizer and, where this module built it instead of transformers' converter, why:
    {'was', 'now', 'why'}. ``load_gguf_tokenizer`` is transformers' reading (``tokenizer_files``); ``read_as`` the
    model type transformers read the file as (its converter is chosen by it: for a 'llama' file named
    "mistral", none)."""
    model = header['tokenizer'].get('model')
    if transformers_reads(header['architecture']) and not _unigram_converter(read_as):
        return load_gguf_tokenizer(path), None
    if model == 'llama':
        if header['tokenizer'].get('add_space_prefix'):
            raise GgufError('import-gguf: the SentencePiece vocabulary adds a space prefix, which import-gguf does '
                            'not rebuild')
        backend, tokens = _sentencepiece_bpe(path, header)
        return _tokenizer_class(family)(tokenizer_object=backend, **_special_kwargs(header, tokens)), {
            'was': 'Unigram over the scores (transformers\' GGUF converter)',
            'now': 'BPE, merges ranked by the scores',
            'why': "llama.cpp's 'llama' tokenizer model merges the adjacent pair whose joined piece scores highest"}
    if model == 'gpt2':
        backend, tokens = _byte_level_bpe(path, header)
        return _tokenizer_class(family)(tokenizer_object=backend, **_special_kwargs(header, tokens)), {
            'was': None if not transformers_reads(header['architecture']) else
            f"transformers' GGUF converter for {read_as!r} (none, or SentencePiece only)",
            'now': f"byte-level BPE split as llama.cpp's {header['tokenizer'].get('pre')!r} pre-tokenizer",
            'why': "transformers' GGUF loader reads this file's vocabulary as another kind"}
    raise GgufError(f"import-gguf: the file's tokenizer model {str(model)!r:.20} is not one import-gguf reads "
                    '(llama, gpt2)')


def _unigram_converter(model_type: str) -> bool:
    """Whether transformers' GGUF tokenizer converter for ``model_type`` builds a Unigram model (its Gemma one)."""
    from transformers.integrations.ggml import GGUF_TO_FAST_CONVERTERS, GGUFGemmaConverter

    converter = GGUF_TO_FAST_CONVERTERS.get(model_type)
    return converter is None or issubclass(converter, GGUFGemmaConverter)


def _tokenizer_class(family):
    """The fast tokenizer class transformers pairs with the family's model type."""
    import transformers
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    name = (TOKENIZER_MAPPING_NAMES.get(family.model_type) or (None, None))[1] or 'PreTrainedTokenizerFast'
    return getattr(transformers, name)


def _special_kwargs(header: dict, tokens: list[str]) -> dict:
    """The special tokens the file declares by id, and whether llama.cpp adds BOS / EOS to a text."""
    tokenizer, declared = header['tokenizer'], header['special_token_ids']
    kwargs = {attr: tokens[index] if 0 <= index < len(tokens) else None for attr, index in declared.items()}
    return {**dict.fromkeys(('bos_token', 'eos_token', 'unk_token', 'pad_token')), **kwargs,
            'add_bos_token': bool(tokenizer.get('add_bos_token', False)),
            'add_eos_token': bool(tokenizer.get('add_eos_token', False))}


def _vocabulary(path: Path):
    import gguf

    reader = gguf.GGUFReader(path)
    fields = reader.fields
    tokens = fields['tokenizer.ggml.tokens'].contents()
    types = fields['tokenizer.ggml.token_type'].contents() if 'tokenizer.ggml.token_type' in fields else \
        [_NORMAL] * len(tokens)
    scores = fields['tokenizer.ggml.scores'].contents() if 'tokenizer.ggml.scores' in fields else None
    merges = fields['tokenizer.ggml.merges'].contents() if 'tokenizer.ggml.merges' in fields else None
    return tokens, types, scores, merges


def _add_declared_tokens(backend, tokens, types) -> None:
    """llama.cpp splits the user-defined pieces off the raw text before it tokenizes the rest, and its control
    tokens are special: both as added tokens matched on the raw text."""
    from tokenizers import AddedToken

    backend.add_tokens([AddedToken(tokens[index], special=False, normalized=False)
                        for index, kind in enumerate(types) if kind == _USER_DEFINED])
    backend.add_special_tokens([AddedToken(tokens[index], special=True, normalized=False)
                                for index, kind in enumerate(types) if kind == _CONTROL])


def _sentencepiece_bpe(path: Path, header: dict):
    """llama.cpp's 'llama' (SentencePiece BPE) tokenizer as a ``tokenizers`` BPE: every split of a normal piece into
    two pieces of the vocabulary is a merge, ranked by the joined piece's score (transformers' ``generate_merges``);
    unknown characters fall back to the byte pieces; spaces are "▁" (no prefix: llama.cpp's add_space_prefix)."""
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import generate_merges

    tokens, types, scores, _ = _vocabulary(path)
    if scores is None:
        raise GgufError("import-gguf: the file's SentencePiece vocabulary has no scores to rank its merges by")
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = generate_merges(vocab, [(token, score) for token, kind, score in zip(tokens, types, scores)
                                     if kind == _NORMAL])
    unk_id = header['special_token_ids'].get('unk_token')
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = Tokenizer(BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None))
    backend.normalizer = normalizers.Replace(' ', '▁')
    backend.decoder = decoders.Sequence([decoders.Replace('▁', ' '), decoders.ByteFallback(), decoders.Fuse()])
    _add_declared_tokens(backend, tokens, types)
    return backend, tokens


def _byte_level_pre_tokenizer(pre: str | None):
    """The ``tokenizers`` pre-tokenizer that splits text as llama.cpp's byte-level pre-tokenizer ``pre`` does (the
    shapes ``gguf_vocab.PRE_TOKENIZERS`` names; no normalizer: llama.cpp normalises nothing)."""
    from tokenizers import Regex, pre_tokenizers

    from dha_train.gguf_vocab import LLAMA3_REGEX, QWEN2_REGEX

    def split(regex):
        return [pre_tokenizers.Split(Regex(regex), behavior='isolated', invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]

    shapes = {'gpt-2': [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)],
              'smollm': [pre_tokenizers.Digits(individual_digits=True),
                         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)],
              'llama-bpe': split(LLAMA3_REGEX), 'qwen2': split(QWEN2_REGEX)}
    shapes['default'] = shapes['gpt-2']
    if (pre or 'default') not in shapes:
        raise GgufError(f"import-gguf: the file's byte-level vocabulary splits text as llama.cpp's {str(pre)!r:.20}, "
                        f"which import-gguf does not rebuild (it rebuilds {', '.join(sorted(shapes))})")
    return pre_tokenizers.Sequence(shapes[pre or 'default'])


def _byte_level_bpe(path: Path, header: dict):
    """llama.cpp's 'gpt2' tokenizer model (byte-level BPE with the file's merges) split as its named pre-tokenizer,
    as a ``tokenizers`` BPE."""
    from tokenizers import Tokenizer, decoders, processors
    from tokenizers.models import BPE

    pre_tokenizer = _byte_level_pre_tokenizer(header['tokenizer'].get('pre'))
    tokens, types, _, merges = _vocabulary(path)
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Tokenizer(BPE(vocab, [tuple(merge.split(' ', 1)) for merge in merges or []], dropout=None,
                            fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    _add_declared_tokens(backend, tokens, types)
    return backend, tokens
