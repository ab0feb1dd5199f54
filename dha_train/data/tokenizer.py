"""Tokenizers: train the quickstart's byte-level BPE, and load any local HF tokenizer folder without a hub."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dha_train.errors import DhaTrainError, InputNotFoundError
from dha_train.tokenizer_files import load_tokenizer_folder
from dha_train.untrusted import UntrustedDataError

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = '<s>', '</s>', '<pad>'


class TokenizerError(DhaTrainError, ValueError):
    """A tokenizer folder that exists but holds no usable HF tokenizer (or one without BOS/EOS)."""


# A HF tokenizer folder holds at least one of these (fast tokenizers: tokenizer.json; slow ones their vocab files).
_TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'tokenizer.model', 'vocab.json', 'vocab.txt')


def train_byte_level_bpe(texts: Iterable[str], out_dir: str | Path, vocab_size: int):
    """Train a byte-level BPE tokenizer on ``texts`` and save it as a HF tokenizer folder.

    Byte-level BPE is lossless, so decoding packed samples gives back the source text exactly.
    No post-processor adds BOS/EOS: data prep adds them itself when it packs documents.
    """

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(out_dir))
    return wrapped


def load_tokenizer(path: str | Path):
    """Load a HF tokenizer from a local folder; never touches a hub. Checks that BOS and EOS exist."""

    path = Path(path)
    if not path.is_dir():
        raise InputNotFoundError(f'tokenizer folder not found: {path} (pass a local HF tokenizer folder)')
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise TokenizerError(f'no tokenizer in {path}: it has none of {", ".join(_TOKENIZER_FILES)} (pass a HF '
                             'tokenizer folder, as save_pretrained writes it)')
    try:
        tokenizer = load_tokenizer_folder(path, f'tokenizer {path}')
    except UntrustedDataError:
        raise
    except Exception as exc:  # transformers raises several types here; all mean "not a usable tokenizer folder"
        lines = str(exc).strip().splitlines()
        reason = lines[0][:300] if lines else type(exc).__name__  # its first line, without page-long lists
        raise TokenizerError(f'cannot load a HF tokenizer from {path}: {reason}') from exc
    if tokenizer.bos_token_id is None or tokenizer.eos_token_id is None:
        raise TokenizerError(f'tokenizer at {path} has no BOS or EOS token; packing needs both')
    return tokenizer


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the token -> id map and the BOS/EOS ids: equal fingerprints mean the same token ids."""
    identity = {'vocab': sorted(tokenizer.get_vocab().items()), 'bos': tokenizer.bos_token_id,
                'eos': tokenizer.eos_token_id}
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]
