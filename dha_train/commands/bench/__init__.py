"""`dha-train bench ...`: the benchmarks, each printing ratios measured in one run (CPU timings are noisy).

- ``throughput``: training tokens/s, 1 process against 2 with FSDP2;
- ``healing-speed``: the healing chain's tokens/s and where its stages spend their time, FSDP2 on 1 and 2 processes
  against one plain process (issue 62);
- ``conversion``: DHA against mean-pool GQA, aligned GQA, AsymGQA and MLA on the quickstart teacher;
- ``moh``: MoH decode attention and decode tokens/s against MHA, and continue-tuning the quickstart teacher;
- ``search``: activation similarity and grouping at LLaMA-2-7B geometry;
- ``load``: peak host memory per rank of loading a pretrained model under FSDP2, every rank against rank 0 alone;
- ``gqa-memory``: parameters and peak memory of DHA Fusion on a GQA source's own K/V heads against expanding them
  to one per query head, at LLaMA-3-8B geometry (meta device, one layer measured);
- ``mla``: one decode step's attention over the MLA latent cache against MHA and GQA at the same cache bytes;
- ``decode``: decode attention time and end-to-end decode tokens/s of MHA, GQA, DHA at 50% and 25% (grouped decode,
  and the expanded path for the before/after), MLA at GQA's bytes and MoH at 75%, on CPU or a GPU;
- ``serve``: the models ``real`` made, exported to GGUF and served by llama.cpp, 1-16 sequences at once: aggregate
  decode tokens/s, K/V MiB and the sequences a cache budget holds, f16 and q8_0 caches, against the source at 2K and
  8K of context; held-out loss from llama.cpp's logits;
- ``real``: every method (mean-pool, aligned GQA, AsymGQA, DHA, MoH) on SmolLM2-135M imported from its GGUF, at 1/3
  and 2/3 of its K+V cache: held-out loss, task accuracy, KV bytes, training tokens, wall time;
- ``real-tables``: the Markdown tables the README and the healing page quote (headline, every row, the ranking), from
  ``real``'s results files;
- ``eval-speed``: evaluation throughput, lm-eval's HFLM against the project's context-sharing scorer on one model,
  task by task: documents and tokens per second, and every document's scores checked equal;
- ``mla-zero``: MLA conversions at 0 training tokens (DeepSeek layout, MLA class, mean-pool + refit and, from a
  local checkout, TransMLA's own converter) at a third and two thirds of SmolLM2-135M's cache, scored on a validation
  text and two held-out texts that no conversion calibrated on, with piqa / arc_easy and per-layer errors;
- ``fusion``: DHA's Fusion on ``real``'s source under a grid of fusion and multiplier learning rates: L_fusion per
  batch, whether it reaches its threshold, and the baked model's loss on a validation text (issue 46);
- ``tokens``: held-out loss against training tokens for DHA, mean-pool GQA CT and mean-pool GQA healed then CT, over
  seeds, on the quickstart teacher, and the tokens each GQA arm needs to reach DHA's loss (issue 46).
"""

from __future__ import annotations

import argparse

from dha_train.commands.arguments import add_teacher_argument
from dha_train.commands.bench.conversion import SECTIONS as CONVERSION_SECTIONS
from dha_train.commands.bench.conversion import run_conversion_bench
from dha_train.commands.bench.decode import ROWS as DECODE_ROWS
from dha_train.commands.bench.decode import SECTIONS as DECODE_SECTIONS
from dha_train.commands.bench.decode import DecodeSettings, run_decode_bench
from dha_train.commands.bench.eval_speed import TASKS as EVAL_SPEED_TASKS
from dha_train.commands.bench.eval_speed import EvalSpeedSettings, run_eval_speed_bench
from dha_train.commands.bench.fusion import FusionBenchSettings, run_fusion_bench
from dha_train.commands.bench.gqa_memory import run_gqa_memory_bench
from dha_train.commands.bench.healing_speed import add_parser as add_healing_speed
from dha_train.commands.bench.load import run_load_bench
from dha_train.commands.bench.mla import run_mla_bench
from dha_train.commands.bench.mla_zero import MlaZeroSettings, run_mla_zero_bench
from dha_train.commands.bench.mla_zero_rows import ROWS as MLA_ZERO_ROWS
from dha_train.commands.bench.mla_zero_rows import TEXTS as MLA_ZERO_TEXTS
from dha_train.commands.bench.moh import SECTIONS as MOH_SECTIONS
from dha_train.commands.bench.moh import run_moh_bench
from dha_train.commands.bench.real.arguments import add_real, add_real_tables
from dha_train.commands.bench.search import run_search_bench
from dha_train.commands.bench.serve import ServeSettings, run_serve_bench
from dha_train.commands.bench.throughput import run_throughput_bench
from dha_train.commands.bench.tokens import DEFAULTS as TOKEN_DEFAULTS
from dha_train.commands.bench.tokens import TEACHERS, TokenBenchSettings, run_token_bench
from dha_train.llama_cpp_engine import CACHE_TYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    bench = parser.add_subparsers(dest='bench_command', required=True)
    throughput = bench.add_parser('throughput', help='training tokens/s: 1 process vs 2 processes with FSDP2')
    throughput.add_argument('--models', nargs='+', default=['tiny', 'small'])
    throughput.add_argument('--processes', nargs='+', type=int, default=[1, 2])
    throughput.add_argument('--steps', type=int, default=12, help='timed batches per run (after warm-up)')
    throughput.add_argument('--out', default=None, help='folder for the run logs and results.json')
    throughput.set_defaults(func=run_throughput)
    add_healing_speed(bench)
    conversion = bench.add_parser('conversion', help='DHA vs mean-pool GQA at a 25%% KV budget on the quickstart '
                                  'teacher: losses, GQA tokens to match DHA fusion, equal budgets, step-time ratios')
    conversion.add_argument('--run', default='quickstart_run', help='quickstart run folder (finished stages reused)')
    conversion.add_argument('--out', default=None, help='results folder (default: <run>/bench_conversion)')
    conversion.add_argument('--gqa-multiple', dest='gqa_multiple', type=float, default=5.0,
                            help='GQA CT length for the tokens-to-match measure, in multiples of the fusion tokens')
    conversion.add_argument('--eval-every', dest='eval_every', type=int, default=10)
    conversion.add_argument('--timing-batches', dest='timing_batches', type=int, default=20)
    conversion.add_argument('--repeats', type=int, default=3, help='interleaved timing rounds (median reported)')
    conversion.add_argument('--progressive', nargs='+', type=int, default=[2], metavar='SIZE',
                            help='sub-group sizes of the progressive fusion compared with one-stage fusion (default 2)')
    conversion.add_argument('--sections', nargs='+', default=list(CONVERSION_SECTIONS), choices=CONVERSION_SECTIONS,
                            help='dha: DHA vs GQA (tokens to match, equal budgets, step times, progressive fusion); '
                                 'aligned: aligned GQA cos/dist x key/value; asym: AsymGQA; mla: MLA at the GQA '
                                 'rows\' cache bytes, trained with and without distillation, and one-choice '
                                 'variants at 0 tokens (default: all)')
    add_teacher_argument(conversion)
    conversion.set_defaults(func=run_conversion)
    moh = bench.add_parser('moh', help='MoH: decode attention time and decode tokens/s at 90/75/50%% active heads '
                           'against MHA; continue-tuning the quickstart teacher to 75%% active')
    moh.add_argument('--sections', nargs='+', default=list(MOH_SECTIONS), choices=MOH_SECTIONS,
                     help='attention: one decode step\'s attention; decode: greedy decode tokens/s; continue: '
                          'yamls/moh/tiny/continue.yaml on the quickstart teacher (default: all)')
    moh.add_argument('--seq-lens', dest='seq_lens', nargs='+', type=int, default=[256, 512, 2048])
    moh.add_argument('--heads', type=int, default=32)
    moh.add_argument('--head-dim', dest='head_dim', type=int, default=64)
    moh.add_argument('--layers', type=int, default=2, help='layers of the decode model')
    moh.add_argument('--calls', type=int, default=200, help='attention calls per timing round')
    moh.add_argument('--decode-tokens', dest='decode_tokens', type=int, default=16, help='tokens per decode round')
    moh.add_argument('--repeats', type=int, default=7, help='interleaved timing rounds (median reported)')
    moh.add_argument('--run', default='quickstart_run', help='quickstart run folder (finished stages reused)')
    moh.add_argument('--steps', type=int, default=None, help='continue-tuning batches (default: the recipe\'s 120)')
    moh.add_argument('--out', default=None, help='results folder (default: <run>/bench_moh with continue, else '
                     'bench_moh)')
    add_teacher_argument(moh)
    moh.set_defaults(func=run_moh)
    search_bench = bench.add_parser('search', help='activation similarity + grouping at LLaMA-2-7B geometry '
                                    '(synthetic activations), with the anchors\' full-rescore annealing as reference')
    search_bench.add_argument('--layers', type=int, default=32)
    search_bench.add_argument('--heads', type=int, default=32)
    search_bench.add_argument('--head-dim', dest='head_dim', type=int, default=128)
    search_bench.add_argument('--tokens', type=int, default=16384, help='calibration tokens per layer')
    search_bench.add_argument('--sample-tokens', dest='sample_tokens', type=int, default=256,
                              help='token subsample for Eq. 1')
    search_bench.add_argument('--groups', type=int, default=8, help='K (and V) heads per layer after grouping')
    search_bench.add_argument('--restarts', type=int, default=8)
    search_bench.add_argument('--steps', type=int, default=None, help='proposals per restart (default 100 x heads)')
    search_bench.add_argument('--reference-matrices', dest='reference_matrices', type=int, default=None,
                              help='matrices the reference anneals (default all: an equal number of proposals)')
    search_bench.add_argument('--seed', type=int, default=0)
    search_bench.add_argument('--out', default=None, help='folder for results.json')
    search_bench.set_defaults(func=run_search)
    load = bench.add_parser('load', help='peak host RSS per rank of loading a pretrained model under FSDP2 with 2 '
                            'processes: every rank loads (model.load_on_rank0=false) vs rank 0 alone')
    load.add_argument('--out', default=None, help='folder for the pretrained model, data, logs and results.json '
                      '(reused when run again)')
    load.set_defaults(func=run_load)
    gqa_memory = bench.add_parser('gqa-memory', help='DHA Fusion on a GQA source at LLaMA-3-8B geometry: parameter '
                                  'bytes (meta device) and one layer\'s measured peak, own K/V heads vs expanded to MHA')
    gqa_memory.add_argument('--tokens', type=int, default=2048, help='tokens of the one-layer forward and backward')
    gqa_memory.add_argument('--out', default=None, help='folder for results.json')
    gqa_memory.set_defaults(func=run_gqa_memory)
    mla = bench.add_parser('mla', help='one decode step\'s attention over the MLA latent cache (up-projections '
                           'absorbed) against MHA and GQA at the same cache bytes, long contexts')
    mla.add_argument('--seq-lens', dest='seq_lens', nargs='+', type=int, default=[512, 2048, 8192])
    mla.add_argument('--heads', type=int, default=32)
    mla.add_argument('--head-dim', dest='head_dim', type=int, default=64)
    mla.add_argument('--kv-heads', dest='kv_heads', nargs='+', type=int, default=[8, 2],
                     help='GQA rows, and the cache bytes of the MLA rows (default 8 2)')
    mla.add_argument('--kv-source', dest='kv_source', type=int, default=8,
                     help='K/V heads of the source the MLA rows are converted from (their rotated key heads)')
    mla.add_argument('--rope-pairs', dest='rope_pairs', type=int, default=4)
    mla.add_argument('--calls', type=int, default=20, help='attention calls per timing round')
    mla.add_argument('--repeats', type=int, default=5, help='interleaved timing rounds (median reported)')
    mla.add_argument('--out', default=None, help='folder for results.json')
    mla.set_defaults(func=run_mla)
    decode = bench.add_parser('decode', help=f'decode attention time and decode tokens/s of {", ".join(DECODE_ROWS)}'
                              ' against MHA, by batch and sequence length, on CPU or a GPU')
    defaults = DecodeSettings()
    decode.add_argument('--batch-sizes', dest='batch_sizes', nargs='+', type=int, default=list(defaults.batch_sizes))
    decode.add_argument('--seq-lens', dest='seq_lens', nargs='+', type=int, default=list(defaults.seq_lens))
    decode.add_argument('--heads', type=int, default=defaults.heads)
    decode.add_argument('--head-dim', dest='head_dim', type=int, default=defaults.head_dim)
    decode.add_argument('--kv-heads', dest='kv_heads', type=int, default=defaults.kv_heads,
                        help='K/V heads of the GQA row, whose cache bytes the MLA row matches')
    decode.add_argument('--rope-pairs', dest='rope_pairs', type=int, default=defaults.rope_pairs,
                        help='RoPE pairs the MLA row keeps per K/V head')
    decode.add_argument('--layers', type=int, default=defaults.layers, help='layers of the end-to-end decode models')
    decode.add_argument('--calls', type=int, default=defaults.calls, help='attention calls per timing round')
    decode.add_argument('--decode-tokens', dest='decode_tokens', type=int, default=defaults.decode_tokens,
                        help='greedy steps per end-to-end timing round')
    decode.add_argument('--repeats', type=int, default=defaults.repeats, help='interleaved rounds (median reported)')
    decode.add_argument('--device', default=defaults.device, help='cpu, cuda or cuda:N')
    decode.add_argument('--dtype', default=defaults.dtype, choices=['float32', 'bfloat16', 'float16'])
    decode.add_argument('--sections', nargs='+', default=list(DECODE_SECTIONS), choices=DECODE_SECTIONS,
                        help='attention: one decode step\'s attention over the cache; decode: end-to-end greedy '
                             'decode tokens/s (default: both)')
    decode.add_argument('--out', default=None, help='folder for results.json')
    decode.set_defaults(func=run_decode)
    add_real(bench)
    add_real_tables(bench)
    zero = bench.add_parser('mla-zero', help='MLA conversions at 0 training tokens at 1/3 and 2/3 of SmolLM2-135M\'s '
                            'cache (TransMLA\'s from a checkout): loss on validation and held-out texts, piqa, arc_easy')
    zero_defaults = MlaZeroSettings()
    zero.add_argument('--out', default=zero_defaults.out, help='a `bench real` folder: its source and data are reused '
                      '(default: bench_real); results in <out>/mla_zero')
    zero.add_argument('--budgets', nargs='+', default=list(zero_defaults.budgets), choices=['kv1', 'kv2'])
    zero.add_argument('--rows', nargs='+', default=list(MLA_ZERO_ROWS), choices=MLA_ZERO_ROWS)
    zero.add_argument('--transmla', default=None, help='a checkout of github.com/fxmeng/TransMLA: its converter runs '
                      'unchanged, on the same calibration sequences (without it, its rows are left out)')
    zero.add_argument('--transmla-python', dest='transmla_python', default=zero_defaults.transmla_python,
                      help='the Python that runs TransMLA (default: this one; it needs transformers and datasets)')
    zero.add_argument('--book', default=None, help='a folder of HTML or text files held out as a second test text '
                      '(default: the Rust book rustup installs, when present)')
    zero.add_argument('--validation', default=None, help='the validation text\'s folder (default: vim\'s help files)')
    zero.add_argument('--fresh', default=None, help='a folder or glob of text never designed or tuned on, held out '
                      '(default: Perl\'s POD and modules, the .pod and .pm under /usr/share/perl/5.*)')
    zero.add_argument('--headers', default=None, help='the validation text of code, a folder or glob (default: C '
                      'headers, /usr/include/**/*.h)')
    zero.add_argument('--markdown', default=None, help='the validation text of Markdown, a folder or glob (default: '
                      '/usr/lib/node_modules/**/*.md)')
    zero.add_argument('--transmla-rope-dims', dest='transmla_rope_dims', type=int, nargs='+',
                      default=list(zero_defaults.transmla_rope_dims), help='TransMLA\'s RoPE key widths searched')
    zero.add_argument('--transmla-folds', dest='transmla_folds', type=int, nargs='+',
                      default=list(zero_defaults.transmla_folds), help='TransMLA\'s FreqFolds searched (with each '
                      'width, where its converter accepts them); the setting lowest on validation is its row')
    zero.add_argument('--text-tokens', dest='text_tokens', type=int, default=zero_defaults.text_tokens,
                      help='tokens scored on the validation, book and fresh texts')
    zero.add_argument('--tokens', type=int, default=zero_defaults.tokens, help='calibration tokens of every row')
    zero.add_argument('--limit', type=int, default=zero_defaults.limit, help='first N documents of each task')
    zero.add_argument('--tasks', nargs='*', default=list(zero_defaults.tasks), help='lm-eval tasks (none: no '
                      'accuracy columns)')
    zero.add_argument('--texts', nargs='+', default=list(zero_defaults.texts), choices=list(MLA_ZERO_TEXTS),
                      help='the texts scored (default: all)')
    zero.add_argument('--device', default='auto', choices=['auto', 'cpu', 'cuda'])
    zero.add_argument('--source', default=zero_defaults.source)
    zero.add_argument('--seed', type=int, default=zero_defaults.seed)
    zero.add_argument('--results', default=None, help='also write the results file here (docs/results/)')
    zero.set_defaults(func=run_mla_zero)
    fusion = bench.add_parser('fusion', help="DHA's Fusion on bench real's source under several fusion / multiplier "
                              'learning rates: L_fusion per batch, convergence, validation loss of the baked model')
    fusion_defaults = FusionBenchSettings()
    fusion.add_argument('--out', default=fusion_defaults.out, help='a `bench real` folder: its source and data are '
                        'reused (default: bench_real); results in <out>/fusion')
    fusion.add_argument('--kv-heads', dest='kv_heads', type=int, default=fusion_defaults.kv_heads,
                        help='K/V heads per layer after Fusion (default 1: a third of SmolLM2\'s cache)')
    fusion.add_argument('--batches', type=int, nargs='+', default=None, help='Fusion budgets in batches, each its '
                        'own run (default: bench real\'s whole training budget); a run stops early at the threshold')
    fusion.add_argument('--omega-lr', dest='omega_lr', type=float, nargs='+', default=list(fusion_defaults.omega_lr),
                        help='fusion operator learning rates to run (default: %(default)s)')
    fusion.add_argument('--lambda-lr', dest='lambda_lr', type=float, nargs='+',
                        default=list(fusion_defaults.lambda_lr), help='multiplier ascent rates (default: %(default)s)')
    fusion.add_argument('--margin-steps', dest='margin_steps', type=int, nargs='+', default=None,
                        help='margin warm-up steps (Eq. 8\'s k; 0: the constraint holds from the first batch); '
                        'default: the recipe\'s, yamls/real/fusion.yaml, as bench real runs it')
    fusion.add_argument('--validation', default=None, help='the validation text (default: vim\'s help files)')
    fusion.add_argument('--results', default=None, help='also write the results file here (docs/results/)')
    fusion.add_argument('--device', default='auto', choices=['auto', 'cpu', 'cuda'])
    fusion.add_argument('--source', default=fusion_defaults.source)
    fusion.add_argument('--seed', type=int, default=fusion_defaults.seed)
    fusion.set_defaults(func=run_fusion)
    tokens = bench.add_parser('tokens', help='held-out loss against training tokens for DHA, mean-pool GQA CT and '
                              'mean-pool GQA healed then CT, over seeds, on the quickstart teacher at 25%% of its K+V '
                              'cache or on SmolLM2-135M at a third or two thirds; the tokens each GQA arm needs to reach '
                              'DHA\'s loss, with intervals')
    token_defaults = TokenBenchSettings()
    tokens.add_argument('--teacher', default=token_defaults.teacher, choices=list(TEACHERS))
    tokens.add_argument('--run', default=None, help='the quickstart run folder (made or reused; default quickstart_run), '
                        'or for smollm2 bench real\'s folder (its source, data and stages; default bench_real)')
    tokens.add_argument('--out', default=None, help='folder for results.json and tokens.png (default: '
                        '<run>/bench_tokens, or <run>/bench_tokens_<budget> for smollm2)')
    tokens.add_argument('--seeds', type=int, nargs='+', default=list(token_defaults.seeds))
    for flag, (what, name) in {'--ct-batches': ('CT batches of DHA and of the healed model', 'ct_batches'),
                               '--gqa-batches': ('CT batches of mean-pool GQA', 'gqa_batches'),
                               '--heal-batches': ('attention transfer batches, and as many of KL distillation',
                                                  'heal_batches'),
                               '--eval-every': ('batches between evaluations of a CT', 'eval_every')}.items():
        defaults = ', '.join(f'{teacher} {values[name]}' for teacher, values in TOKEN_DEFAULTS.items())
        tokens.add_argument(flag, dest=name, type=int, default=None, help=f'{what} (default: {defaults})')
    tokens.add_argument('--budget', default=None, choices=['kv1', 'kv2'],
                        help='smollm2: a third (kv1) or two thirds (kv2) of its K+V cache (default: kv2)')
    tokens.add_argument('--fusion-batches', dest='fusion_batches', type=int, default=None,
                        help='smollm2: Fusion\'s cap in batches (default: bench real\'s training budget)')
    tokens.add_argument('--text', default=None, help='smollm2: the held-out text, a folder or a glob (default: the '
                        'Rust book\'s chapters)')
    tokens.add_argument('--text-tokens', dest='text_tokens', type=int, default=None,
                        help='smollm2: tokens of the held-out text scored at each evaluation (default: 8192)')
    tokens.add_argument('--device', default=token_defaults.device, choices=['auto', 'cpu', 'cuda'])
    tokens.add_argument('--results', default=None, help='also write the results file here (docs/results/)')
    tokens.set_defaults(func=run_tokens)
    speed = bench.add_parser('eval-speed', help="evaluation throughput: lm-eval's HFLM against the context-sharing "
                             'scorer `eval` uses, per task, on one model (scores checked equal)')
    speed_defaults = EvalSpeedSettings()
    speed.add_argument('--model', default=speed_defaults.model, help='an HF folder, or a GGUF import-gguf takes '
                       '(default: the bundled SmolLM2-135M)')
    speed.add_argument('--tasks', nargs='+', default=list(EVAL_SPEED_TASKS))
    speed.add_argument('--limit', type=int, default=speed_defaults.limit, help='documents per task')
    speed.add_argument('--batch-size', dest='batch_size', type=int, default=speed_defaults.batch_size)
    speed.add_argument('--out', default=speed_defaults.out, help='folder for results.json (and the import)')
    speed.add_argument('--results', default=None,
                       help='also write the results to this file (the docs keep docs/results/bench_eval_speed.json)')
    speed.set_defaults(func=run_eval_speed)
    serve = bench.add_parser('serve', help="bench real's models as GGUF in llama.cpp on this CPU, many sequences at "
                             'once: aggregate decode tokens/s, K/V MiB and sequences that fit a cache budget, f16 and '
                             'q8_0 caches, against the source; held-out loss from llama.cpp\'s logits')
    defaults = ServeSettings()
    serve.add_argument('--real', nargs='+', default=defaults.real,
                       help='`dha-train bench real` folders or results files whose rows are pooled (default: '
                            'bench_real)')
    serve.add_argument('--out', default=defaults.out, help='folder for the GGUF files, results.json and the plots')
    serve.add_argument('--contexts', nargs='+', type=int, default=defaults.contexts,
                       help=f'tokens of context of every sequence (default {defaults.contexts})')
    serve.add_argument('--sequences', nargs='+', type=int, default=defaults.sequences,
                       help=f'sequences decoded together, each in its own K/V stream (default {defaults.sequences})')
    serve.add_argument('--outtypes', nargs='+', default=defaults.outtypes, choices=['f32', 'f16', 'bf16', 'q8_0'],
                       help=f'GGUF weight types (default {defaults.outtypes})')
    serve.add_argument('--cache-types', dest='cache_types', nargs='+', default=defaults.cache_types,
                       choices=list(CACHE_TYPES), help=f'K/V cache types, llama.cpp\'s -ctk/-ctv (default '
                                                       f'{defaults.cache_types})')
    serve.add_argument('--cache-budget-mib', dest='cache_budget_mib', type=float, default=defaults.cache_budget_mib,
                       help='the cache budget the sequences of the longest context are counted in (default 1024)')
    serve.add_argument('--decode-tokens', dest='decode_tokens', type=int, default=defaults.decode_tokens,
                       help=f'decode steps a round (default {defaults.decode_tokens})')
    serve.add_argument('--repeats', type=int, default=defaults.repeats, help='timing rounds (best reported)')
    serve.add_argument('--threads', type=int, default=None, help='llama.cpp threads (default: every core)')
    serve.add_argument('--no-loss', dest='loss', action='store_false', help='leave out the held-out losses')
    serve.add_argument('--loss-sequences', dest='loss_sequences', type=int, default=defaults.loss_sequences,
                       help=f'held-out sequences the losses are taken on (default {defaults.loss_sequences})')
    serve.set_defaults(func=run_serve)


def run_throughput(args: argparse.Namespace) -> int:
    run_throughput_bench(models=args.models, processes=args.processes, steps=args.steps, out=args.out)
    return 0


def run_conversion(args: argparse.Namespace) -> int:
    run_conversion_bench(run=args.run, out=args.out, gqa_multiple=args.gqa_multiple, eval_every=args.eval_every,
                         timing_batches=args.timing_batches, repeats=args.repeats, teacher=args.teacher,
                         progressive_sizes=args.progressive, sections=args.sections)
    return 0


def run_moh(args: argparse.Namespace) -> int:
    run_moh_bench(sections=args.sections, seq_lens=args.seq_lens, heads=args.heads, head_dim=args.head_dim,
                  layers=args.layers, calls=args.calls, decode_tokens=args.decode_tokens, repeats=args.repeats,
                  run=args.run, steps=args.steps, out=args.out, teacher=args.teacher)
    return 0


def run_search(args: argparse.Namespace) -> int:
    run_search_bench(layers=args.layers, heads=args.heads, head_dim=args.head_dim, tokens=args.tokens,
                     sample_tokens=args.sample_tokens, groups=args.groups, restarts=args.restarts, steps=args.steps,
                     reference_matrices=args.reference_matrices, seed=args.seed, out=args.out)
    return 0


def run_load(args: argparse.Namespace) -> int:
    run_load_bench(out=args.out)
    return 0


def run_gqa_memory(args: argparse.Namespace) -> int:
    run_gqa_memory_bench(out=args.out, tokens=args.tokens)
    return 0


def run_mla(args: argparse.Namespace) -> int:
    run_mla_bench(seq_lens=args.seq_lens, out=args.out, heads=args.heads, head_dim=args.head_dim,
                  kv_heads=args.kv_heads, kv_source=args.kv_source, rope_pairs=args.rope_pairs, calls=args.calls,
                  repeats=args.repeats)
    return 0


def run_decode(args: argparse.Namespace) -> int:
    settings = DecodeSettings(**{name: getattr(args, name) for name in DecodeSettings.__dataclass_fields__
                                 if name != 'seed'})
    run_decode_bench(settings, out=args.out)
    return 0


def run_eval_speed(args: argparse.Namespace) -> int:
    run_eval_speed_bench(EvalSpeedSettings(model=args.model, tasks=tuple(args.tasks), limit=args.limit,
                                           batch_size=args.batch_size, out=args.out,
                                           results=args.results))
    return 0


def run_serve(args: argparse.Namespace) -> int:
    run_serve_bench(ServeSettings(**{name: getattr(args, name) for name in ServeSettings.__dataclass_fields__}))
    return 0


def run_fusion(args: argparse.Namespace) -> int:
    run_fusion_bench(FusionBenchSettings(**{name: getattr(args, name) for name in FusionBenchSettings.__dataclass_fields__
                                            if hasattr(args, name)}))
    return 0


def run_tokens(args: argparse.Namespace) -> int:
    run_token_bench(TokenBenchSettings(**{name: getattr(args, name) for name in TokenBenchSettings.__dataclass_fields__
                                          if hasattr(args, name)}))
    return 0


def run_mla_zero(args: argparse.Namespace) -> int:
    run_mla_zero_bench(MlaZeroSettings(**{name: getattr(args, name) for name in MlaZeroSettings.__dataclass_fields__
                                          if hasattr(args, name)}))
    return 0
