"""A GGUF file run in llama.cpp, through ``llama-cpp-python``'s bindings: what the tests check an export against and
what ``dha-train bench serve`` times.

- ``tokenize``: llama.cpp's own tokenizer (the GGUF's vocabulary, merges and pre-tokenizer);
- ``logits``: one row per position of a prompt, from llama.cpp's forward pass;
- ``greedy``: argmax decoding over llama.cpp's own K/V cache;
- ``kv_cache``: the cache llama.cpp allocated for ``n_ctx`` tokens, as its loader reports it (the
  ``llama_kv_cache: size = ... K (f16): ... MiB, V (f16): ... MiB`` line, read from its log).

Flash attention is on by default, as llama-server's ``--flash-attn auto`` turns it on for the CPU: without it llama.cpp
stores V transposed and pads every layer's V cache to the widest layer's, so a model whose layers keep different K/V
head counts (a per-layer DHA, ``deci`` in GGUF) would hold the widest layer's V cache in every layer.

``llama-cpp-python`` is a source distribution that builds llama.cpp with the machine's cmake and compiler; ``make
install`` installs the pinned version (``pyproject.toml``, the ``serve`` extra). Importing this module does not
import it: ``require_llama_cpp`` says how to install it when it is missing.
"""

from __future__ import annotations

import ctypes
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dha_train.errors import DhaTrainError

LLAMA_CPP_REQUIREMENT = 'llama-cpp-python==0.3.36'
# llama_kv_cache: size =   48.00 MiB (  8192 cells,  30 layers,  1/1 seqs), K (f16):   24.00 MiB, V (f16):   24.00 MiB
_KV_LINE = re.compile(r'llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers.*K \((\w+)\): +([\d.]+) '
                      r'MiB, V \((\w+)\): +([\d.]+) MiB')


class LlamaCppError(DhaTrainError):
    """llama.cpp is not installed, or it refused a file."""


def require_llama_cpp():
    """The ``llama_cpp`` module, or a one-line error saying how to install it."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise LlamaCppError(f'running GGUF files needs llama.cpp\'s Python bindings: pip install '
                            f'"{LLAMA_CPP_REQUIREMENT}" (the [serve] extra; `make install` does it; it builds llama.cpp '
                            'with cmake and a C++ compiler, about 10 minutes on 2 cores)') from exc
    return llama_cpp


@dataclass(frozen=True)
class KvCache:
    """The cache as llama.cpp's loader reports it (MiB to two decimals, as it prints them)."""
    mib: float
    cells: int
    layers: int
    k_type: str
    k_mib: float
    v_type: str
    v_mib: float


_LOG: list[str] = []


def _capture_log():
    """Route llama.cpp's log into ``_LOG`` (kept referenced: ctypes must not free the callback)."""
    llama_cpp = require_llama_cpp()

    @llama_cpp.llama_log_callback
    def callback(level, text, user_data):
        _LOG.append(text.decode('utf-8', errors='replace'))

    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    return callback


_CALLBACK = None


class LlamaCppModel:
    """A GGUF file loaded in llama.cpp on the CPU."""

    def __init__(self, path: str | Path, *, n_ctx: int = 2048, threads: int | None = None, all_logits: bool = False,
                 n_batch: int = 512, cache_type: str = 'f16', flash_attention: bool = True, vocab_only: bool = False):
        global _CALLBACK
        llama_cpp = require_llama_cpp()
        path = Path(path)
        if not path.is_file():
            raise LlamaCppError(f'no GGUF file at {path}')
        if _CALLBACK is None:
            _CALLBACK = _capture_log()
        types = {'f16': llama_cpp.GGML_TYPE_F16, 'f32': llama_cpp.GGML_TYPE_F32, 'q8_0': llama_cpp.GGML_TYPE_Q8_0}
        start = len(_LOG)
        threads = threads or os.cpu_count() or 1
        try:
            self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                                       n_threads=threads, n_threads_batch=threads, logits_all=all_logits,
                                       type_k=types[cache_type], type_v=types[cache_type],
                                       flash_attn=flash_attention, vocab_only=vocab_only, verbose=False, seed=0)
        except ValueError as exc:  # llama-cpp-python's wording for a file the loader refused
            log = ''.join(_LOG[start:]).strip().splitlines()
            reason = next((line for line in reversed(log) if 'error' in line.lower()), log[-1] if log else '')
            raise LlamaCppError(f'llama.cpp could not load {path}: {reason or exc}') from None
        self.log = ''.join(_LOG[start:])
        self.path, self.all_logits = path, all_logits
        self.kv_cache = _parse_kv(self.log)

    @property
    def vocab_size(self) -> int:
        return self.llm.n_vocab()

    def tokenize(self, text: str, *, add_special: bool = False) -> list[int]:
        """llama.cpp's token ids for ``text`` (``add_special``: the BOS the GGUF says to add)."""
        return list(self.llm.tokenize(text.encode('utf-8'), add_bos=add_special, special=False))

    def logits(self, tokens: list[int]) -> np.ndarray:
        """(positions, vocabulary) float32 logits of a fresh forward pass over ``tokens``."""
        if not self.all_logits:
            raise LlamaCppError('logits over a prompt need the model loaded with all_logits=True')
        self.llm.reset()
        self.llm.eval(tokens)
        return np.array(self.llm.scores[:len(tokens)], dtype=np.float32)

    def _last_logits(self) -> np.ndarray:
        llama_cpp = require_llama_cpp()
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.vocab_size,))

    def greedy(self, tokens: list[int], new_tokens: int) -> list[int]:
        """``new_tokens`` argmax tokens after ``tokens``, each step reading llama.cpp's K/V cache."""
        self.llm.reset()
        self.llm.eval(tokens)
        out = []
        for _ in range(new_tokens):
            token = int(np.argmax(self._last_logits()))
            out.append(token)
            self.llm.eval([token])
        return out

    def timed_prompt(self, tokens: list[int]) -> tuple[float, object, int]:
        """``tokens`` processed from an empty cache: (prompt tokens/s, the state after it, the argmax next token)."""
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(tokens)
        seconds = time.perf_counter() - start
        return len(tokens) / seconds, self.llm.save_state(), int(np.argmax(self._last_logits()))

    def timed_decode(self, state, token: int, new_tokens: int) -> float:
        """Decode tokens/s of ``new_tokens`` greedy single-token steps from ``state`` (``timed_prompt``'s), so
        repeated rounds decode over the same cache without processing the prompt again."""
        self.llm.load_state(state)
        start = time.perf_counter()
        for _ in range(new_tokens):
            self.llm.eval([token])
            token = int(np.argmax(self._last_logits()))
        return new_tokens / (time.perf_counter() - start)

    def close(self) -> None:
        self.llm.close()

    def __enter__(self) -> LlamaCppModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _parse_kv(log: str) -> KvCache | None:
    found = _KV_LINE.search(log)
    if found is None:
        return None
    mib, cells, layers, k_type, k_mib, v_type, v_mib = found.groups()
    return KvCache(float(mib), int(cells), int(layers), k_type, float(k_mib), v_type, float(v_mib))
