"""`dha-train bench moh`: what MoH's sparse decode saves, and continue-tuning the quickstart teacher to MoH.

Sections (``sections``):

- ``attention``: one new token's attention over a cache of ``seq`` positions (``heads`` heads of ``head_dim``,
  batch 1, fp32): MHA's SDPA over every head against ``MohLlamaAttention.active_heads_attention`` with 90, 75 and
  50% of the heads active (H/2 shared heads plus the top-k routed; H/4 shared at 50%), the active routed heads drawn
  at random per call. Each call reads another copy of the cache (512 MiB of copies in all), so the cache comes from
  memory as in a real decode over many layers, not from the CPU caches. Median over ``repeats`` interleaved rounds
  of ``calls`` calls each, as a time per call and as a ratio to MHA measured in the same round.
- ``decode``: greedy decode tokens/s of a ``layers``-layer model of that attention geometry (transformers' own KV
  cache) after a prompt of ``seq`` tokens, MHA against the MoH model with the same weights (query-norm router),
  ``decode_tokens`` tokens per round, median over ``repeats`` interleaved rounds. Projections and MLPs cost the same
  in both, so the end-to-end gain is smaller than the attention gain and grows with the context.
- ``continue``: ``yamls/moh/tiny/continue.yaml`` on the quickstart teacher (75% active, query-norm router): the
  validation loss right after the surgery (its first evaluation) and after training, against the MHA teacher's,
  and against the teacher trained on as many tokens with the tiny CT recipe (more training alone also helps it).
  Runs the quickstart first (reusing its finished stages).

Prints tables and writes results.json in ``out`` (default ``bench_moh``, or ``<run>/bench_moh`` with ``continue``).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.nn import functional as F
from transformers import DynamicCache, LlamaForCausalLM

from dha_train.algorithms.mixture_of_heads import MixtureOfHeads
from dha_train.bench_support import COLD_BYTES, median_rounds, moh_budget
from dha_train.config import ConfigError
from dha_train.models.modeling_moh import MohLlamaAttention, MohLlamaConfig, MohLlamaForCausalLM
from dha_train.quickstart import run_quickstart
from dha_train.stages import SEQ_LEN, ct_curve, mean_eval, train_stage, train_tokens, validation_loss

SECTIONS = ('attention', 'decode', 'continue')
ACTIVE_FRACTIONS = (0.9, 0.75, 0.5)


def _moh_config(heads: int, head_dim: int, layers: int, shared: int, top_k: int, vocab: int = 4096,
                intermediate: int | None = None, max_len: int = 4096):
    config = MohLlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=heads,
                            num_hidden_layers=layers, intermediate_size=intermediate or heads * head_dim,
                            vocab_size=vocab, max_position_embeddings=max_len, moh_router='query_norm',
                            moh_shared_heads=shared, moh_top_k=top_k)
    config._attn_implementation = 'sdpa'
    return config


def attention_bench(seq_lens: Sequence[int], heads: int, head_dim: int, calls: int, repeats: int,
                    seed: int = 0) -> list[dict]:
    rows = []
    generator = torch.Generator().manual_seed(seed)
    for seq in seq_lens:
        # Real decode reads each layer's cache once per token, from memory: cycle through enough copies that the
        # working set (COLD_BYTES) dwarfs the CPU caches, or the smaller MoH working set would sit in cache.
        copies = max(2, -(-COLD_BYTES // (2 * heads * seq * head_dim * 4)))
        query = torch.randn(1, heads, 1, head_dim, generator=generator)
        caches = [(torch.randn(1, heads, seq, head_dim, generator=generator),
                   torch.randn(1, heads, seq, head_dim, generator=generator)) for _ in range(copies)]
        scale = head_dim ** -0.5

        def mha():
            start = time.perf_counter()
            for call in range(calls):
                key, value = caches[call % copies]
                F.scaled_dot_product_attention(query, key, value, scale=scale)
            return (time.perf_counter() - start) / calls

        timers = {'mha': mha}
        for fraction in ACTIVE_FRACTIONS:
            shared, top_k = moh_budget(heads, fraction)
            with torch.device('meta'):  # only the attention maths is timed: no projection weights needed
                attn = MohLlamaAttention(_moh_config(heads, head_dim, 1, shared, top_k), 0)
            gates = []
            for _ in range(calls):  # the routed heads a token picks vary from token to token
                gate = torch.zeros(1, 1, heads)
                gate[..., :shared] = 1
                gate[..., shared + torch.randperm(heads - shared, generator=generator)[:top_k]] = 1
                gates.append(gate)

            def moh(attn=attn, gates=gates):
                start = time.perf_counter()
                for call, gate in enumerate(gates):
                    key, value = caches[call % copies]
                    if attn.active_heads_attention(query, key, value, gate, None) is None:  # every head, as MHA
                        F.scaled_dot_product_attention(query, key, value, scale=scale)
                return (time.perf_counter() - start) / calls
            timers[f'{fraction:.0%}'] = moh
        for timer in timers.values():  # warm-up
            timer()
        medians = median_rounds(timers, repeats)
        row = {'seq': seq, 'mha_us': medians['mha'] * 1e6}
        for fraction in ACTIVE_FRACTIONS:
            label = f'{fraction:.0%}'
            row[f'{label}_us'] = medians[label] * 1e6
            row[f'{label}_ratio'] = medians[label] / medians['mha']
        rows.append(row)
    return rows


def decode_bench(seq_lens: Sequence[int], heads: int, head_dim: int, layers: int, decode_tokens: int,
                 repeats: int, seed: int = 0) -> list[dict]:
    torch.manual_seed(seed)
    base = _moh_config(heads, head_dim, layers, heads // 2, heads // 4, max_len=max(seq_lens) + decode_tokens + 8)
    mha = LlamaForCausalLM(base).eval()
    models = {'mha': mha}
    for fraction in ACTIVE_FRACTIONS:
        shared, top_k = moh_budget(heads, fraction)
        moh = MohLlamaForCausalLM(_moh_config(heads, head_dim, layers, shared, top_k,
                                              max_len=base.max_position_embeddings)).eval()
        moh.load_state_dict(mha.state_dict())  # the same weights: only the attention differs
        models[f'{fraction:.0%}'] = moh
    rows = []
    for seq in seq_lens:
        prompt = torch.randint(0, base.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq))
        caches, firsts = {}, {}
        with torch.no_grad():
            for name, model in models.items():
                cache = DynamicCache()
                logits = model(prompt, past_key_values=cache, use_cache=True).logits
                caches[name], firsts[name] = cache, logits[:, -1:].argmax(-1)

        def decoder(name):
            def run():
                model, cache, token = models[name], caches[name], firsts[name]
                with torch.no_grad():
                    start = time.perf_counter()
                    for _ in range(decode_tokens):
                        token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                    elapsed = time.perf_counter() - start
                cache.crop(seq)  # back to the prompt, for the next round
                return elapsed
            return run
        timers = {name: decoder(name) for name in models}
        for timer in timers.values():  # warm-up
            timer()
        medians = median_rounds(timers, repeats)
        row = {'seq': seq, 'mha_tokens_per_s': decode_tokens / medians['mha']}
        for fraction in ACTIVE_FRACTIONS:
            label = f'{fraction:.0%}'
            row[f'{label}_tokens_per_s'] = decode_tokens / medians[label]
            row[f'{label}_speedup'] = medians['mha'] / medians[label]
        rows.append(row)
    return rows


def continue_bench(run: Path, work: Path, steps: int | None = None) -> dict:
    teacher = run / 'export' / 'hf'
    mha_loss = validation_loss(run / 'data', teacher)
    shutil.rmtree(work / 'tiny-moh75', ignore_errors=True)  # a measurement starts fresh: never autoresume
    overrides = [f'variables.model_path={teacher}', f'variables.data_root={run / "data"}',
                 f'variables.save_root={work}', 'eval_first=true']
    if steps is not None:
        overrides.append(f'variables.steps={steps}')
    trainer, config, history = train_stage('moh/tiny/continue.yaml', overrides, None)
    if not history['eval']:
        raise RuntimeError('bench moh: the continue-tuning run logged no evaluation')
    moh = MixtureOfHeads.of(trainer.state, 'bench moh')
    after = mean_eval(history, -1)['mean']
    # Control: the MHA teacher trained on as many tokens (the tiny CT recipe), since more training alone helps it.
    batches = train_tokens(config, SEQ_LEN) // (config.global_train_batch_size * SEQ_LEN)
    mha_trained = ct_curve(run / 'data', work, teacher, 'bench-mha-ct', batches, batches, SEQ_LEN)['final']
    return {'mha': mha_loss, 'after_surgery': mean_eval(history, 0)['mean'], 'after_training': after,
            'relative_gap': (after - mha_loss) / mha_loss, 'mha_after_same_tokens': mha_trained,
            'tokens': train_tokens(config, SEQ_LEN),
            'active_fraction': float(moh.routing['load'].mean()),
            'balance_loss': float(moh.routing.get('balance_loss', float('nan')))}


def _print_table(title: str, rows: list[dict], value: str, ratio: str) -> None:
    """One row per sequence length: MHA's value, then each active fraction's value and ratio."""
    print(f'\n{title}')
    print(f'{"seq":>6} {"MHA":>9}' + ''.join(f' {f"{f:.0%} active":>20}' for f in ACTIVE_FRACTIONS))
    for row in rows:
        print(f'{row["seq"]:>6} {row[f"mha{value}"]:>9.1f}' + ''.join(
            f' {row[f"{f:.0%}{value}"]:>11.1f} ({row[f"{f:.0%}{ratio}"]:.2f}x)' for f in ACTIVE_FRACTIONS))


def run_moh_bench(sections: Sequence[str] = SECTIONS, seq_lens: Sequence[int] = (256, 512, 2048), heads: int = 32,
                  head_dim: int = 64, layers: int = 2, calls: int = 200, decode_tokens: int = 16, repeats: int = 7,
                  run: str | Path = 'quickstart_run', steps: int | None = None, out: str | Path | None = None,
                  teacher: Sequence[str] = ()) -> dict:
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown or not sections:
        raise ConfigError(f'bench moh: sections must be among {", ".join(SECTIONS)}, got {list(sections)}')
    run = Path(run)
    out = Path(out) if out is not None else (run / 'bench_moh' if 'continue' in sections else Path('bench_moh'))
    if 'continue' in sections:
        # First: the quickstart refuses a non-empty folder that is not yet a run, such as one holding only out.
        run_quickstart(out=run, teacher=list(teacher))
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {'settings': {'heads': heads, 'head_dim': head_dim, 'layers': layers, 'seq_lens': list(seq_lens),
                                  'calls': calls, 'decode_tokens': decode_tokens, 'repeats': repeats,
                                  'threads': torch.get_num_threads()}}

    def save() -> None:
        (out / 'results.json').write_text(json.dumps(results, indent=2))

    if 'attention' in sections:
        results['attention'] = attention_bench(seq_lens, heads, head_dim, calls, repeats)
        save()
        _print_table(f'Decode attention, one token over the cache ({heads} heads x {head_dim}, batch 1, fp32; '
                     'median us per call, ratio to MHA):', results['attention'], '_us', '_ratio')
    if 'decode' in sections:
        results['decode'] = decode_bench(seq_lens, heads, head_dim, layers, decode_tokens, repeats)
        save()
        _print_table(f'Greedy decode, {layers} layers of that geometry, after a prompt of seq tokens (tokens/s, '
                     'speed-up over MHA):', results['decode'], '_tokens_per_s', '_speedup')
    if 'continue' in sections:
        results['continue'] = continue_bench(run, out / 'runs', steps)
        save()
        c = results['continue']
        print(f'\nContinue-tuning the quickstart teacher to MoH ({c["active_fraction"]:.0%} of heads active, '
              f'{c["tokens"]:,} tokens): validation loss MHA {c["mha"]:.4f}, MoH right after surgery '
              f'{c["after_surgery"]:.4f}, after training {c["after_training"]:.4f} '
              f'({c["relative_gap"]:+.1%} against MHA); the MHA teacher trained on as many tokens: '
              f'{c["mha_after_same_tokens"]:.4f}')
    print(f'\nresults: {out / "results.json"}')
    return results
