"""A GGUF file run in llama.cpp, through ``llama-cpp-python``'s bindings: what the tests check an export against and
what ``dha-train bench serve`` times.

- ``tokenize``: llama.cpp's own tokenizer (the GGUF's vocabulary, merges and pre-tokenizer);
- ``logits``: one row per position of a prompt, from llama.cpp's forward pass;
- ``greedy``: argmax decoding over llama.cpp's own K/V cache;
- ``kv_cache``: the cache llama.cpp allocated for ``n_ctx`` tokens, as its loader reports it (the
  ``llama_kv_cache: size = ... K (f16): ... MiB, V (f16): ... MiB`` line, read from its log);
- ``LlamaCppSequences``: many sequences decoded together in one context, one token of each per step (llama.cpp's
  batch API, as llama-server decodes its slots), each sequence in its own K/V stream.

Flash attention is on by default, as llama-server's ``--flash-attn auto`` turns it on for the CPU: without it llama.cpp
stores V transposed and pads every layer's V cache to the widest layer's, so a model whose layers keep different K/V
head counts (a per-layer DHA, ``deci`` in GGUF) would hold the widest layer's V cache in every layer.

Weight repacking (llama.cpp's "extra buffer types") is off where llama.cpp was built with its AMX kernels
(``repacks_weights``): on AMX Xeons those kernels crash the process at the first decode of a quantized file
(Q4_1, Q4_K_M) and abort the scheduler with a q8_0 cache on a DeepSeek-format file (docs/serving.md, "AMX CPUs").

``llama-cpp-python`` is a source distribution that builds llama.cpp with the machine's cmake and compiler; ``make
install`` installs the pinned version (``pyproject.toml``, the ``serve`` extra). Importing this module does not
import it: ``require_llama_cpp`` says how to install it when it is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
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


@functools.cache
def repacks_weights() -> bool:
    """Whether models load with llama.cpp's extra buffer types (weights repacked for the CPU's kernels): not when
    the library holds AMX kernels (its system line says ``AMX_INT8 = 1``), whose repack crashes on AMX CPUs
    (llama-server's ``--no-repack`` is the same switch)."""
    llama_cpp = require_llama_cpp()
    return 'AMX_INT8 = 1' not in llama_cpp.llama_print_system_info().decode('utf-8', errors='replace')


def model_params(llama_cpp, base=None):
    """llama.cpp's model parameters with ``use_extra_bufts`` set by ``repacks_weights``."""
    params = base if base is not None else llama_cpp.llama_model_default_params()
    params.use_extra_bufts = repacks_weights()
    return params


@contextlib.contextmanager
def _repack_setting(llama_cpp):
    """``llama_cpp.Llama`` builds its model parameters from ``llama_model_default_params`` and (in 0.3.36) takes no
    argument for ``use_extra_bufts``: the defaults it reads carry ``model_params``' setting while it loads."""
    bindings = llama_cpp.llama_cpp
    defaults = bindings.llama_model_default_params
    bindings.llama_model_default_params = lambda: model_params(llama_cpp, defaults())
    try:
        yield
    finally:
        bindings.llama_model_default_params = defaults


_LOG: list[str] = []
CACHE_TYPES = ('f16', 'f32', 'q8_0')  # K/V cache types (llama.cpp's -ctk / -ctv); q8_0 needs flash attention


def _capture_log():
    """Route llama.cpp's log into ``_LOG`` (kept referenced: ctypes must not free the callback)."""
    llama_cpp = require_llama_cpp()

    @llama_cpp.llama_log_callback
    def callback(level, text, user_data):
        _LOG.append(text.decode('utf-8', errors='replace'))

    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    return callback


_CALLBACK = None


def _log_start() -> int:
    """Where llama.cpp's log continues from (the log routed into ``_LOG`` on first use): what ``_refusal`` and
    ``_parse_kv`` read after it."""
    global _CALLBACK
    if _CALLBACK is None:
        _CALLBACK = _capture_log()
    return len(_LOG)


class LlamaCppModel:
    """A GGUF file loaded in llama.cpp on the CPU."""

    def __init__(self, path: str | Path, *, n_ctx: int = 2048, threads: int | None = None, all_logits: bool = False,
                 n_batch: int = 512, cache_type: str = 'f16', flash_attention: bool = True, vocab_only: bool = False):
        llama_cpp = require_llama_cpp()
        path = Path(path)
        if not path.is_file():
            raise LlamaCppError(f'no GGUF file at {path}')
        types = _ggml_types(cache_type)
        start = _log_start()
        threads = threads or os.cpu_count() or 1
        try:
            with _repack_setting(llama_cpp):
                self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                                           n_threads=threads, n_threads_batch=threads, logits_all=all_logits,
                                           type_k=types, type_v=types, flash_attn=flash_attention,
                                           vocab_only=vocab_only, verbose=False, seed=0)
        except ValueError as exc:  # llama-cpp-python's wording for a file the loader refused
            raise LlamaCppError(f'llama.cpp could not load {path}: {_refusal(start) or exc}') from None
        self.log = ''.join(_LOG[start:])
        self.path, self.all_logits = path, all_logits
        self.kv_cache = _parse_kv(self.log)

    @property
    def vocab_size(self) -> int:
        return self.llm.n_vocab()

    def tokenize(self, text: str, *, add_special: bool = False) -> list[int]:
        """llama.cpp's token ids for ``text`` (``add_special``: the BOS the GGUF says to add)."""
        return list(self.llm.tokenize(text.encode('utf-8'), add_bos=add_special, special=False))

    def detokenize(self, tokens: list[int]) -> str:
        return self.llm.detokenize(tokens).decode('utf-8', errors='replace')

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


# llama.cpp's own quantizer's file types (llama-quantize's names): the weights as users run them in llama.cpp/ollama
QUANTIZED_TYPES = ('q4_0', 'q4_1', 'q4_k_m', 'q5_k_m', 'q6_k', 'q8_0')


def quantize_gguf(source: str | Path, out: str | Path, file_type: str, threads: int | None = None) -> None:
    """``source`` (an f16/f32 GGUF file) quantized by llama.cpp's own quantizer into ``out`` (llama-quantize's
    work: it picks each tensor's type for ``file_type``, falling back where a row is not a whole number of blocks)."""
    llama_cpp = require_llama_cpp()
    if file_type not in QUANTIZED_TYPES:
        raise LlamaCppError(f"quantized type must be one of {', '.join(QUANTIZED_TYPES)}, got '{file_type}'")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f'LLAMA_FTYPE_MOSTLY_{file_type.upper()}')
    params.nthread = threads or os.cpu_count() or 1
    start = _log_start()
    if llama_cpp.llama_model_quantize(str(source).encode('utf-8'), str(out).encode('utf-8'), ctypes.byref(params)):
        raise LlamaCppError(f'llama.cpp could not quantize {source} to {file_type}: {_refusal(start)}')


def _ggml_types(cache_type: str) -> int:
    llama_cpp = require_llama_cpp()
    if cache_type not in CACHE_TYPES:
        raise LlamaCppError(f"cache type must be one of {', '.join(CACHE_TYPES)}, got '{cache_type}'")
    return {'f16': llama_cpp.GGML_TYPE_F16, 'f32': llama_cpp.GGML_TYPE_F32,
            'q8_0': llama_cpp.GGML_TYPE_Q8_0}[cache_type]


def _refusal(start: int) -> str:
    """The line of llama.cpp's log since ``start`` that says why it refused (its last error line)."""
    log = ''.join(_LOG[start:]).strip().splitlines()
    return next((line.strip() for line in reversed(log) if 'error' in line.lower()), log[-1] if log else '')


class LlamaCppSequences:
    """One GGUF file in llama.cpp with room for ``sequences`` sequences of ``context`` tokens each, decoded together.

    Each sequence has its own K/V stream (``kv_unified`` off: what llama-server does with ``-np N`` given, and what
    llama.cpp advises for sequences that share no prefix), so a step over N sequences reads N separate caches. A
    prompt is processed once into sequence 0 and copied into the others with ``llama_memory_seq_cp``, which between
    streams copies the cache's memory: every sequence then holds its own copy, as if it had processed the prompt
    itself, without N times the prompt's time. Decoding steps hand each active sequence one token in one batch."""

    def __init__(self, path: str | Path, *, sequences: int, context: int, threads: int | None = None,
                 cache_type: str = 'f16', n_batch: int = 512):
        llama_cpp = require_llama_cpp()
        path = Path(path)
        if not path.is_file():
            raise LlamaCppError(f'no GGUF file at {path}')
        if sequences < 1 or context < 1:
            raise LlamaCppError(f'sequences and context must be >= 1, got {sequences} and {context}')
        threads = threads or os.cpu_count() or 1
        start = _log_start()
        params = model_params(llama_cpp)
        params.n_gpu_layers = 0
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode('utf-8'), params)
        if not self.model:
            raise LlamaCppError(f'llama.cpp could not load {path}: {_refusal(start)}')
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = sequences * context, n_batch, n_batch
        params.n_seq_max, params.kv_unified = sequences, False
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.type_k = params.type_v = _ggml_types(cache_type)
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise LlamaCppError(f'llama.cpp refused a {cache_type} K/V cache for {path}: {_refusal(start)}')
        self.log = ''.join(_LOG[start:])
        self.kv_cache = _parse_kv(self.log)
        self.path, self.sequences, self.context, self.cache_type = path, sequences, context, cache_type
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(max(n_batch, sequences), 0, 1)
        self.n_batch, self.prompt_length, self.next_token = n_batch, 0, -1

    @property
    def kv_mib_per_sequence(self) -> float:
        """K+V MiB of one sequence's stream, from llama.cpp's report of the whole cache."""
        return (self.kv_cache.k_mib + self.kv_cache.v_mib) / self.sequences

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of (token, position, sequence, wants logits) entries."""
        llama_cpp = require_llama_cpp()
        batch = self.batch
        batch.n_tokens = len(entries)
        for i, (token, position, sequence, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
            batch.seq_id[i][0], batch.logits[i] = sequence, logits
        code = llama_cpp.llama_decode(self.ctx, batch)
        if code != 0:
            raise LlamaCppError(f'llama_decode returned {code} for {self.path}')

    def _argmax(self, index: int) -> int:
        llama_cpp = require_llama_cpp()
        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, index), shape=(self.vocab_size,))
        return int(np.argmax(row))

    def fill(self, tokens: list[int]) -> float:
        """``tokens`` processed into sequence 0 from an empty cache (prompt tokens/s), then copied into every other
        sequence; ``next_token`` is the argmax after them. Decoding resumes after them."""
        llama_cpp = require_llama_cpp()
        if not 0 < len(tokens) < self.context:
            raise LlamaCppError(f'a prompt of {len(tokens)} tokens does not leave room to decode in {self.context}')
        llama_cpp.llama_memory_clear(self.memory, True)
        started = time.perf_counter()
        for first in range(0, len(tokens), self.n_batch):
            chunk = tokens[first:first + self.n_batch]
            last = first + len(chunk) == len(tokens)
            self._decode([(token, first + i, 0, last and i == len(chunk) - 1) for i, token in enumerate(chunk)])
        seconds = time.perf_counter() - started
        self.next_token = self._argmax(-1)  # the last output of the last batch
        for sequence in range(1, self.sequences):
            llama_cpp.llama_memory_seq_cp(self.memory, 0, sequence, -1, -1)
        self.prompt_length = len(tokens)
        # one untimed step of every sequence: the copies are made at the next decode, and the first step warms up
        self.decode(self.sequences, 1, [self.next_token] * self.sequences)
        return len(tokens) / seconds

    def decode(self, active: int, steps: int, first_tokens: list[int]) -> tuple[float, list[list[int]]]:
        """``steps`` greedy steps of sequences ``0..active-1`` together, each from the end of the prompt with its own
        first token: (aggregate tokens/s, each sequence's argmax tokens). Their new tokens are removed after, so
        every round reads the same cache."""
        llama_cpp = require_llama_cpp()
        if not 1 <= active <= self.sequences or len(first_tokens) != active:
            raise LlamaCppError(f'decode: {active} active sequences of {self.sequences}, {len(first_tokens)} tokens')
        if self.prompt_length + steps > self.context:
            raise LlamaCppError(f'decode: {steps} steps after {self.prompt_length} tokens exceed {self.context}')
        tokens, generated = list(first_tokens), [[] for _ in range(active)]
        started = time.perf_counter()
        for step in range(steps):
            self._decode([(tokens[s], self.prompt_length + step, s, True) for s in range(active)])
            tokens = [self._argmax(s) for s in range(active)]
            for sequence, token in enumerate(tokens):
                generated[sequence].append(token)
        seconds = time.perf_counter() - started
        for sequence in range(active):
            llama_cpp.llama_memory_seq_rm(self.memory, sequence, self.prompt_length, -1)
        return active * steps / seconds, generated

    def close(self) -> None:
        llama_cpp = require_llama_cpp()
        if self.ctx:
            llama_cpp.llama_batch_free(self.batch)
            llama_cpp.llama_free(self.ctx)
            llama_cpp.llama_model_free(self.model)
            self.ctx = None

    def __enter__(self) -> LlamaCppSequences:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _parse_kv(log: str) -> KvCache | None:
    found = _KV_LINE.search(log)
    if found is None:
        return None
    mib, cells, layers, k_type, k_mib, v_type, v_mib = found.groups()
    return KvCache(float(mib), int(cells), int(layers), k_type, float(k_mib), v_type, float(v_mib))
