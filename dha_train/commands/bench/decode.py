"""`dha-train bench decode`: what a smaller cache buys at decode, every compressed attention against MHA in one run.

Geometry: ``heads`` query heads of ``head_dim`` (default 32 x 64, LLaMA-2-7B's), one new token per sequence over
``seq`` cached positions, at every batch size and sequence length asked. The rows, each with its cache numbers per
token and layer:

- ``mha``: LLaMA with one K/V head per query head, HF's SDPA attention;
- ``gqa8``: the HF LLaMA class with ``kv_heads`` (default 8) K/V heads, HF's SDPA attention;
- ``dha50`` / ``dha25``: the DHA class at 50% / 25% of MHA's cache, uneven groups whose K and V groupings differ
  (random, fixed seed), decoding grouped by compact head (``DhaLlamaAttention.grouped_attention``);
- ``dha25-expanded``: the same 25% model through the path every DHA step took before (the compact K/V expanded to
  the query heads, then SDPA), for the before/after;
- ``mla@gqa8``: the MLA class at ``gqa8``'s cache numbers (``rope_pairs`` rotated pairs per K/V head of a
  GQA-``kv_heads`` layout, the rest as the latent), its absorbed decode (``latent_attention``);
- ``moh75``: MoH at 75% active heads (H/2 shared), its decode attention over the active heads.

Two measures, ratios to MHA from the same round (median of ``repeats`` interleaved rounds):

- **attention**: one decode step's attention over the cache alone, the caches cycled through copies
  (``COLD_BYTES`` in all) so they come from memory, as in a real decode over many layers;
- **decode**: end-to-end greedy decode tokens/s of a ``layers``-layer model of each kind whose cache is filled to
  ``seq`` positions (random states: decode time does not depend on the values), transformers' ``DynamicCache``.

The targets of issue 26 on this CPU, marked in the table: at seq 8192, DHA at 25% at most 0.4x MHA's attention time
(memory-bound, the floor is 0.25x) and MLA at GQA-8's bytes at most 1.0x.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from dha_train.bench_support import COLD_BYTES, median_rounds, moh_budget
from dha_train.config import ConfigError
from dha_train.models.head_map import HeadMap
from dha_train.models.modeling_dha import DhaLlamaConfig, DhaLlamaForCausalLM
from dha_train.models.modeling_mla import MlaLlamaConfig, MlaLlamaForCausalLM
from dha_train.models.modeling_moh import MohLlamaConfig, MohLlamaForCausalLM

ROWS = ('mha', 'gqa8', 'dha50', 'dha25', 'dha25-expanded', 'mla@gqa8', 'moh75')
TARGETS = {'dha25': 0.4, 'mla@gqa8': 1.0}  # attention time at the longest seq, x MHA
TARGET_SEQ = 8192
SECTIONS = ('attention', 'decode')


@dataclass
class DecodeSettings:
    batch_sizes: Sequence[int] = (1, 8)
    seq_lens: Sequence[int] = (512, 2048, 8192)
    heads: int = 32
    head_dim: int = 64
    kv_heads: int = 8
    rope_pairs: int = 4
    layers: int = 2
    calls: int = 10
    decode_tokens: int = 8
    repeats: int = 3
    device: str = 'cpu'
    dtype: str = 'float32'
    sections: Sequence[str] = SECTIONS
    seed: int = 0


def _uneven_partition(heads: int, parts: int, rng: random.Random) -> list[list[int]]:
    """``heads`` query heads in ``parts`` groups of random, unequal sizes (each at least 1), members shuffled."""
    order = list(range(heads))
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, heads), parts - 1))
    return [sorted(order[a:b]) for a, b in zip([0, *cuts], [*cuts, heads])]


def dha_head_map(settings: DecodeSettings, fraction: float) -> HeadMap:
    """A DHA map at ``fraction`` of MHA's K+V heads per layer, the slots split unevenly between K and V."""
    heads, rng = settings.heads, random.Random(settings.seed + int(fraction * 100))
    slots = round(2 * heads * fraction)
    lowest, highest = max(1, slots - heads, slots // 4), min(heads, slots - 1, 3 * slots // 4)
    keys = [rng.randint(lowest, highest) for _ in range(settings.layers)]
    return HeadMap.dha(key_partitions=[_uneven_partition(heads, k, rng) for k in keys],
                       value_partitions=[_uneven_partition(heads, slots - k, rng) for k in keys],
                       num_heads=heads, head_dim=settings.head_dim)


def _llama_fields(settings: DecodeSettings) -> dict:
    hidden = settings.heads * settings.head_dim
    return dict(hidden_size=hidden, num_attention_heads=settings.heads, head_dim=settings.head_dim,
                num_hidden_layers=settings.layers, intermediate_size=hidden, vocab_size=4096,
                max_position_embeddings=max(settings.seq_lens) + settings.decode_tokens + 8)


def build_models(settings: DecodeSettings) -> dict[str, torch.nn.Module]:
    """One model per row (``dha25-expanded`` shares ``dha25``'s), sdpa, eval mode, on the settings' device/dtype."""
    heads, fields = settings.heads, _llama_fields(settings)
    if heads % settings.kv_heads:
        raise ConfigError(f'bench decode: --kv-heads {settings.kv_heads} must divide {heads} heads')
    mla_rank = 2 * settings.kv_heads * settings.head_dim - settings.kv_heads * 2 * settings.rope_pairs
    if mla_rank < 1 or settings.rope_pairs > settings.head_dim // 2:
        raise ConfigError(f'bench decode: {settings.rope_pairs} RoPE pairs per head leave no MLA latent at GQA-'
                          f'{settings.kv_heads} bytes')
    shared, top_k = moh_budget(heads, 0.75)
    configs = {
        'mha': LlamaConfig(num_key_value_heads=heads, **fields),
        'gqa8': LlamaConfig(num_key_value_heads=settings.kv_heads, **fields),
        'dha50': DhaLlamaConfig(head_map=dha_head_map(settings, 0.5).to_dict(), **fields),
        'dha25': DhaLlamaConfig(head_map=dha_head_map(settings, 0.25).to_dict(), **fields),
        'mla@gqa8': MlaLlamaConfig(num_key_value_heads=settings.kv_heads, mla_ranks=[mla_rank] * settings.layers,
                                   mla_rope_pairs=[[list(range(settings.rope_pairs))] * settings.kv_heads]
                                   * settings.layers, **fields),
        'moh75': MohLlamaConfig(num_key_value_heads=heads, moh_router='query_norm', moh_shared_heads=shared,
                                moh_top_k=top_k, **fields),
    }
    classes = {'dha50': DhaLlamaForCausalLM, 'dha25': DhaLlamaForCausalLM, 'mla@gqa8': MlaLlamaForCausalLM,
               'moh75': MohLlamaForCausalLM}
    dtype = getattr(torch, settings.dtype)
    models = {}
    torch.manual_seed(settings.seed)
    for name, config in configs.items():
        config._attn_implementation = 'sdpa'
        models[name] = classes.get(name, LlamaForCausalLM)(config).to(settings.device, dtype).eval()
    return models


def cache_shapes(model: torch.nn.Module, batch: int, seq: int) -> list[tuple[tuple, tuple]]:
    """Per layer, the shapes of what the model's cache holds in its key and value slots for ``seq`` positions."""
    shapes = []
    for layer in model.model.layers:
        attention = layer.self_attn
        if hasattr(attention, 'latent_attention'):  # MLA: the latent and the rotated key part
            shapes.append(((batch, 1, seq, attention.rank),
                           (batch, attention.num_kv_heads, seq, attention.rope_width)))
        elif hasattr(attention, 'num_key_heads'):  # DHA: the compact heads
            shapes.append(((batch, attention.num_key_heads, seq, attention.head_dim),
                           (batch, attention.num_value_heads, seq, attention.head_dim)))
        else:
            kv = model.config.num_key_value_heads
            shapes.append(((batch, kv, seq, model.config.head_dim), (batch, kv, seq, model.config.head_dim)))
    return shapes


def cache_numbers_per_token(model: torch.nn.Module) -> int:
    """Cache numbers per token and layer (layer 0's, with the first layer's shapes)."""
    key, value = cache_shapes(model, 1, 1)[0]
    return torch.Size(key).numel() + torch.Size(value).numel()


def _synchronised(device: str):
    if device.startswith('cuda'):
        return torch.cuda.synchronize
    return lambda: None


def attention_timers(models: dict, settings: DecodeSettings, batch: int, seq: int,
                     generator: torch.Generator) -> dict:
    """Per row, a timer of ``calls`` decode-step attention calls over cold caches (layer 0's shapes)."""
    device, dtype, sync = settings.device, getattr(torch, settings.dtype), _synchronised(settings.device)
    heads, dim = settings.heads, settings.head_dim
    query = torch.randn(batch, heads, 1, dim, generator=generator).to(device, dtype)
    timers = {}
    for name in ROWS:
        model = models[name.removesuffix('-expanded')]
        attention = model.model.layers[0].self_attn
        key_shape, value_shape = cache_shapes(model, batch, seq)[0]
        size = (torch.Size(key_shape).numel() + torch.Size(value_shape).numel()) * dtype.itemsize
        copies = [(torch.randn(key_shape, generator=generator).to(device, dtype),
                   torch.randn(value_shape, generator=generator).to(device, dtype))
                  for _ in range(max(2, -(-COLD_BYTES // size)))]
        if name.startswith('mla'):
            nope = attention.nope_width
            q_nope, q_rope = query[..., :nope].contiguous(), query[..., nope:].contiguous()

            def step(key, value, attention=attention, q_nope=q_nope, q_rope=q_rope):
                attention.latent_attention(q_nope, q_rope, key, value, None)
        elif name == 'moh75':
            shared, top_k = attention.shared_heads, attention.top_k
            gates = []
            for _ in range(settings.calls):  # the routed heads a token picks vary from token to token
                gate = torch.zeros(batch, 1, heads)
                for row in range(batch):
                    gate[row, 0, :shared] = 1
                    gate[row, 0, shared + torch.randperm(heads - shared, generator=generator)[:top_k]] = 1
                gates.append(gate.to(device, dtype))
            step_index = iter(range(10 ** 9))

            def step(key, value, attention=attention, gates=gates, step_index=step_index):
                gate = gates[next(step_index) % len(gates)]
                if attention.active_heads_attention(query, key, value, gate, None) is None:  # every head
                    sdpa_attention_forward(attention, query, key, value, None, scaling=attention.scaling)
        elif name.startswith('dha'):
            method = attention.expanded_attention if name.endswith('-expanded') else attention.grouped_attention

            def step(key, value, method=method):
                method(query, key, value, None)
        else:  # the HF LLaMA class's own SDPA attention (repeat_kv or enable_gqa, as transformers decides)
            def step(key, value, attention=attention):
                sdpa_attention_forward(attention, query, key, value, None, scaling=attention.scaling)

        def run(step=step, copies=copies):
            sync()
            start = time.perf_counter()
            for call in range(settings.calls):
                step(*copies[call % len(copies)])
            sync()
            return (time.perf_counter() - start) / settings.calls
        timers[name] = run
    return timers


def decode_timers(models: dict, settings: DecodeSettings, batch: int, seq: int,
                  generator: torch.Generator) -> dict:
    """Per model, a timer of ``decode_tokens`` greedy steps from a cache filled to ``seq`` positions."""
    device, dtype, sync = settings.device, getattr(torch, settings.dtype), _synchronised(settings.device)
    timers = {}
    for name, model in models.items():
        cache = DynamicCache()
        for layer, (key_shape, value_shape) in enumerate(cache_shapes(model, batch, seq)):
            cache.update(torch.randn(key_shape, generator=generator).to(device, dtype),
                         torch.randn(value_shape, generator=generator).to(device, dtype), layer)
        first = torch.randint(0, model.config.vocab_size, (batch, 1), generator=generator).to(device)

        def run(model=model, cache=cache, first=first):
            token = first
            sync()
            start = time.perf_counter()
            for _ in range(settings.decode_tokens):
                token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            sync()
            elapsed = time.perf_counter() - start
            cache.crop(seq)  # back to the filled positions for the next round
            return elapsed
        timers[name] = run
    return timers


def _timed_rows(timers: dict, settings: DecodeSettings, batch: int, seq: int, models: dict, measure: str) -> list:
    for timer in timers.values():  # warm-up
        timer()
    medians = median_rounds(timers, settings.repeats)
    rows = []
    for name, seconds in medians.items():
        row = {'measure': measure, 'batch': batch, 'seq': seq, 'row': name,
               'cache_numbers_per_token': cache_numbers_per_token(models[name.removesuffix('-expanded')])}
        if measure == 'attention':  # time: lower is faster
            row.update(us=seconds * 1e6, ratio_to_mha=seconds / medians['mha'])
        else:  # throughput: higher is faster
            row.update(tokens_per_s=batch * settings.decode_tokens / seconds, ratio_to_mha=medians['mha'] / seconds)
        rows.append(row)
    return rows


def target_verdicts(rows: list[dict]) -> list[dict]:
    """For each target row, its attention ratio at ``TARGET_SEQ`` per batch and whether the target is met."""
    verdicts = []
    for row in rows:
        if row['measure'] == 'attention' and row['seq'] == TARGET_SEQ and row['row'] in TARGETS:
            verdicts.append({'row': row['row'], 'batch': row['batch'], 'ratio_to_mha': row['ratio_to_mha'],
                             'target': TARGETS[row['row']], 'met': row['ratio_to_mha'] <= TARGETS[row['row']]})
    return verdicts


def run_decode_bench(settings: DecodeSettings, out: str | None = None) -> dict:
    unknown = set(settings.sections) - set(SECTIONS)
    if unknown:
        raise ConfigError(f'bench decode: unknown sections {sorted(unknown)}; choose from {", ".join(SECTIONS)}')
    if settings.device.startswith('cuda') and not torch.cuda.is_available():
        raise ConfigError(f'bench decode: --device {settings.device} but torch sees no CUDA device')
    generator = torch.Generator().manual_seed(settings.seed)
    rows: list[dict] = []
    with torch.no_grad():
        models = build_models(settings)
        for batch in settings.batch_sizes:
            for seq in settings.seq_lens:
                if 'attention' in settings.sections:
                    rows += _timed_rows(attention_timers(models, settings, batch, seq, generator), settings, batch,
                                        seq, models, 'attention')
                if 'decode' in settings.sections:
                    rows += _timed_rows(decode_timers(models, settings, batch, seq, generator), settings, batch, seq,
                                        models, 'decode')
                print(f'  batch {batch} seq {seq} done', flush=True)
    results = {'rows': rows, 'targets': target_verdicts(rows), 'settings': asdict(settings),
               'device': torch.cuda.get_device_name() if settings.device.startswith('cuda') else 'cpu'}
    print_tables(results)
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / 'results.json').write_text(json.dumps(results, indent=2))
    return results


def print_tables(results: dict) -> None:
    rows, settings = results['rows'], results['settings']
    print(f'bench decode on {results["device"]}, {settings["dtype"]}, {settings["heads"]} x {settings["head_dim"]} '
          f'heads, {settings["layers"]} layers; ratios to MHA measured in the same round')
    for measure, value, unit in (('attention', 'us', 'us/step'), ('decode', 'tokens_per_s', 'tokens/s')):
        chosen = [row for row in rows if row['measure'] == measure]
        if not chosen:
            continue
        keys = sorted({(row['batch'], row['seq']) for row in chosen})
        print(f'\n{measure}: {unit} (' + ('time x MHA\'s, lower is faster)' if measure == 'attention'
                                          else 'tokens/s x MHA\'s, higher is faster)'))
        print(f'  {"row":<15} {"cache/token":>11} ' + ' '.join(f'{f"b{b} s{s}":>17}' for b, s in keys))
        for name in ROWS:
            cells = {(row['batch'], row['seq']): row for row in chosen if row['row'] == name}
            if not cells:
                continue
            numbers = next(iter(cells.values()))['cache_numbers_per_token']
            print(f'  {name:<15} {numbers:>11} ' + ' '.join(
                f'{cells[key][value]:>9.1f} ({cells[key]["ratio_to_mha"]:>4.2f}x)' for key in keys))
    for verdict in results['targets']:
        print(f'target: {verdict["row"]} attention at seq {TARGET_SEQ}, batch {verdict["batch"]}: '
              f'{verdict["ratio_to_mha"]:.2f}x MHA against <= {verdict["target"]}x: '
              f'{"met" if verdict["met"] else "NOT met"}')
