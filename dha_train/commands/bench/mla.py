"""`dha-train bench mla`: one decode step's attention over the latent cache against MHA and GQA, in one run.

Geometry: ``heads`` query heads of ``head_dim`` (default 32 x 64), batch 1, fp32, one new token over ``seq``
cached positions. Rows:

- ``mha``: SDPA over ``heads`` K/V heads;
- ``gqa<G>``: SDPA over G shared K/V heads (``enable_gqa``), for G in ``kv_heads``;
- ``mla@gqa<G>``: ``MlaLlamaAttention.latent_attention`` (the up-projections absorbed: scores against the latent,
  output mixed in the latent) at the same cache numbers per token as ``gqa<G>``: ``rope_pairs`` rotated pairs per
  K/V head of a GQA-``kv_source`` source, the rest of the budget as the latent rank.

The caches are cycled through copies (``cold_bytes`` in all, default ``COLD_BYTES``, as ``bench moh`` does) so
they come from memory, as in a real decode over many layers. Median over ``repeats`` interleaved rounds of ``calls`` calls; ratios to MHA from the
same round. MLA reads as few bytes as the GQA row of its budget but does ``heads x rank`` multiply-adds per cached
token for the scores and as many for the output (GQA: ``heads x head_dim``), so the ratio shows which bound the
hardware hits; on a GPU the balance differs from this CPU's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.nn import functional as F

from dha_train.bench_support import COLD_BYTES, median_rounds
from dha_train.config import ConfigError
from dha_train.models.modeling_mla import MlaLlamaAttention, MlaLlamaConfig


def _mla_attention(heads: int, head_dim: int, kv_heads: int, rope_pairs: int, rank: int) -> MlaLlamaAttention:
    config = MlaLlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                            head_dim=head_dim, num_hidden_layers=1, intermediate_size=64, vocab_size=16,
                            mla_ranks=[rank], mla_rope_pairs=[[list(range(rope_pairs))] * kv_heads])
    return MlaLlamaAttention(config, 0).eval()


def attention_rows(seq_lens: Sequence[int], heads: int = 32, head_dim: int = 64, kv_heads: Sequence[int] = (8, 2),
                   kv_source: int = 8, rope_pairs: int = 4, calls: int = 20, repeats: int = 5,
                   seed: int = 0, cold_bytes: int = COLD_BYTES) -> list[dict]:
    """The timed rows, every seq and row; to be run under ``torch.no_grad()`` (``run_mla_bench`` does)."""
    if any(heads % g for g in [*kv_heads, kv_source]):
        raise ConfigError(f'bench mla: K/V head counts {list(kv_heads)} and {kv_source} must divide {heads} heads')
    generator = torch.Generator().manual_seed(seed)
    scale = head_dim ** -0.5
    rows = []
    for seq in seq_lens:
        query = torch.randn(1, heads, 1, head_dim, generator=generator)

        def copies_of(*shapes):
            size = sum(torch.Size(shape).numel() for shape in shapes) * 4
            count = max(2, -(-cold_bytes // size))
            return [tuple(torch.randn(*shape, generator=generator) for shape in shapes) for _ in range(count)]

        def sdpa_timer(groups: int):
            caches = copies_of((1, groups, seq, head_dim), (1, groups, seq, head_dim))

            def run():
                start = time.perf_counter()
                for call in range(calls):
                    key, value = caches[call % len(caches)]
                    F.scaled_dot_product_attention(query, key, value, scale=scale, enable_gqa=groups != heads)
                return (time.perf_counter() - start) / calls
            return run

        timers = {'mha': sdpa_timer(heads)}
        cache_values = {'mha': 2 * heads * head_dim}
        for groups in kv_heads:
            timers[f'gqa{groups}'] = sdpa_timer(groups)
            cache_values[f'gqa{groups}'] = 2 * groups * head_dim
            rank = 2 * groups * head_dim - kv_source * 2 * rope_pairs
            if rank < 1:
                raise ConfigError(f'bench mla: GQA-{groups} bytes leave no latent after {rope_pairs} pairs of '
                                  f'{kv_source} heads')
            attention = _mla_attention(heads, head_dim, kv_source, rope_pairs, rank)
            nope = head_dim - 2 * rope_pairs
            query_nope, query_rope = query[..., :nope].contiguous(), query[..., nope:].contiguous()
            caches = copies_of((1, 1, seq, rank), (1, kv_source, seq, 2 * rope_pairs))

            def mla(attention=attention, caches=caches, query_nope=query_nope, query_rope=query_rope):
                start = time.perf_counter()
                for call in range(calls):
                    latent, key_rope = caches[call % len(caches)]
                    attention.latent_attention(query_nope, query_rope, latent, key_rope, None)
                return (time.perf_counter() - start) / calls
            timers[f'mla@gqa{groups}'] = mla
            cache_values[f'mla@gqa{groups}'] = rank + kv_source * 2 * rope_pairs
        for timer in timers.values():  # warm-up
            timer()
        medians = median_rounds(timers, repeats)
        for name, seconds in medians.items():
            rows.append({'seq': seq, 'row': name, 'cache_values_per_token': cache_values[name],
                         'us': seconds * 1e6, 'ratio_to_mha': seconds / medians['mha']})
    return rows


def run_mla_bench(seq_lens: Sequence[int] = (512, 2048, 8192), out: str | None = None, **settings) -> dict:
    with torch.no_grad():  # a context, not set_grad_enabled: callers in the same process keep their grad mode
        rows = attention_rows(seq_lens, **settings)
    print('one decode step\'s attention (batch 1, fp32, cold caches): time per call and ratio to MHA')
    print(f'  {"seq":>6} {"row":<10} {"cache numbers/token":>19} {"us":>9} {"x MHA":>7}')
    for row in rows:
        print(f'  {row["seq"]:>6} {row["row"]:<10} {row["cache_values_per_token"]:>19} {row["us"]:>9.1f} '
              f'{row["ratio_to_mha"]:>7.2f}')
    results = {'attention': rows, 'settings': {'seq_lens': list(seq_lens), **settings}}
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / 'results.json').write_text(json.dumps(results, indent=2))
    return results
