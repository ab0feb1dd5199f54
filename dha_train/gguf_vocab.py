"""The tokenizer of an ``export-gguf`` file, from the folder's ``tokenizer.json``: byte-level BPE vocabularies (the
``gpt2`` tokenizer model of llama.cpp), with the BOS, EOS and PAD ids, whether the tokenizer adds BOS / EOS, and the
chat template.

llama.cpp splits text before BPE with a regex it knows by name (``tokenizer.ggml.pre``); the pre-tokenizer of the
``tokenizer.json`` is matched to one by its structure (``PRE_TOKENIZERS``), and a tokenizer llama.cpp would split
differently is refused. The names taken: ``gpt-2`` (ByteLevel with its own regex), ``smollm`` (single digits, then
ByteLevel), ``llama-bpe`` (LLaMA-3's Split regex, then ByteLevel without its regex) and ``qwen2`` (the same with
single digits: Qwen2, Qwen2.5 and Qwen3). A normalizer is refused, except NFC (Qwen's): llama.cpp does not
normalise, so the two agree on text that is NFC already (as llama.cpp's own converter leaves them), and a text with
decomposed accents can split differently. SentencePiece-style vocabularies (Gemma's: BPE with byte fallback behind
a ``Replace`` normalizer, llama.cpp's ``llama`` tokenizer model with scores) are refused by their normalizer:
``tokenizer.json`` holds no scores to write.
"""

from __future__ import annotations

import json
from pathlib import Path

from dha_train.gguf_tensors import GgufExportError
from dha_train.tokenizer_files import load_tokenizer_folder

# The Split regexes of LLaMA-3's and Qwen2's tokenizer.json (one digit at a time in Qwen's, up to three in LLaMA's)
_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = _WORDS + r'\p{N}{1,3}' + _REST
QWEN2_REGEX = _WORDS + r'\p{N}' + _REST
# A tokenizer.json pre-tokenizer, in short (``_pre_tokenizer_shape``) -> llama.cpp's name for the same splitting.
PRE_TOKENIZERS = {
    ('ByteLevel:regex',): 'gpt-2',
    ('Digits:individual', 'ByteLevel:regex'): 'smollm',
    (f'Split:Isolated:{LLAMA3_REGEX}', 'ByteLevel:bytes'): 'llama-bpe',
    (f'Split:Isolated:{QWEN2_REGEX}', 'ByteLevel:bytes'): 'qwen2',
}
_NORMALIZERS_TAKEN = ('NFC',)


def _pre_tokenizer_shape(pre: dict | None) -> tuple[str, ...]:
    if not pre:
        return ()
    parts = pre['pretokenizers'] if pre.get('type') == 'Sequence' else [pre]
    shape = []
    for part in parts:
        kind = part.get('type')
        if kind == 'ByteLevel':
            shape.append('ByteLevel:other' if part.get('add_prefix_space') else
                         'ByteLevel:regex' if part.get('use_regex', True) else 'ByteLevel:bytes')
        elif kind == 'Digits':
            shape.append('Digits:individual' if part.get('individual_digits') else 'Digits:grouped')
        elif kind == 'Split' and not part.get('invert') and 'Regex' in (part.get('pattern') or {}):
            shape.append(f"Split:{part.get('behavior')}:{part['pattern']['Regex']}")
        else:
            shape.append(str(kind))
    return tuple(shape)


def _check_normalizer(normalizer: dict | None) -> None:
    normalizer = normalizer or {}
    parts = normalizer.get('normalizers', []) if normalizer.get('type') == 'Sequence' else [normalizer]
    kinds = [part.get('type') for part in parts if part]
    if any(kind not in _NORMALIZERS_TAKEN for kind in kinds):
        raise GgufExportError(f"export-gguf: the tokenizer normalises text ({' + '.join(map(str, kinds))}) before "
                              "splitting it; llama.cpp's BPE tokenizers do not, so text would tokenize differently")


def add_tokenizer(writer, folder: Path, config) -> dict:
    """The folder's BPE tokenizer into ``writer``; returns the special token ids written."""
    import gguf

    tokenizer_file = folder / 'tokenizer.json'
    if not tokenizer_file.is_file():
        raise GgufExportError(f'export-gguf: {folder} has no tokenizer.json; a GGUF carries its tokenizer so that it '
                              'runs alone: copy the source\'s tokenizer files into the folder')
    spec = json.loads(tokenizer_file.read_text())
    model = spec.get('model') or {}
    if model.get('type') != 'BPE':
        raise GgufExportError(f"export-gguf: the tokenizer is a {model.get('type')} model; this exporter writes "
                              'byte-level BPE tokenizers (gpt2-style) only')
    _check_normalizer(spec.get('normalizer'))
    shape = _pre_tokenizer_shape(spec.get('pre_tokenizer'))
    if shape not in PRE_TOKENIZERS:
        shown = ' + '.join(part[:40] for part in shape) or 'no pre-tokenizer'
        raise GgufExportError(f'export-gguf: the tokenizer splits text with {shown}, which matches none of the '
                              f'llama.cpp pre-tokenizers this exporter names ({", ".join(PRE_TOKENIZERS.values())}); '
                              'llama.cpp would tokenize text differently')
    tokenizer = load_tokenizer_folder(folder, f'export-gguf: {folder}', config=config)
    vocab = tokenizer.get_vocab()
    size = max(len(vocab), config.vocab_size)
    by_id = {index: token for token, index in vocab.items()}
    added = {entry['id']: entry for entry in spec.get('added_tokens', [])}
    tokens, types = [], []
    for index in range(size):
        if index not in by_id:  # the embedding is larger than the vocabulary: unused rows
            tokens.append(f'[PAD{index}]')
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(by_id[index])
        entry = added.get(index)
        types.append(gguf.TokenType.NORMAL if entry is None else
                     gguf.TokenType.CONTROL if entry.get('special') else gguf.TokenType.USER_DEFINED)
    merges = model.get('merges', [])
    merges = [' '.join(merge) if isinstance(merge, list) else merge for merge in merges]
    writer.add_tokenizer_model('gpt2')
    writer.add_tokenizer_pre(PRE_TOKENIZERS[shape])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    special = {}
    for name, add in (('bos', writer.add_bos_token_id), ('eos', writer.add_eos_token_id),
                      ('pad', writer.add_pad_token_id), ('unk', writer.add_unk_token_id)):
        token_id = getattr(tokenizer, f'{name}_token_id')
        if token_id is not None:
            add(int(token_id))
            special[name] = int(token_id)
    # Whether the HF tokenizer puts BOS / EOS around a text itself; llama.cpp then does the same.
    probe = tokenizer('a')['input_ids']
    writer.add_add_bos_token(bool(probe) and 'bos' in special and probe[0] == special['bos'])
    writer.add_add_eos_token(bool(probe) and 'eos' in special and probe[-1] == special['eos'])
    template = getattr(tokenizer, 'chat_template', None)
    if template:
        writer.add_chat_template(template)
    return special
