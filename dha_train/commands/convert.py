"""`dha-train convert`: mean-pool to a head map (``dha_train.conversion.mean_pool``) or convert to MLA, in the
project's MLA class (``dha_train.conversion.mla``) or in DeepSeek's format (``dha_train.conversion.deepseek``)."""

from __future__ import annotations

import argparse

from dha_train.config import ConfigError
from dha_train.conversion.deepseek import DeepseekSettings, convert_to_deepseek
from dha_train.conversion.mean_pool import convert_checkpoint
from dha_train.conversion.mla import FACTORISATIONS, RANK_CHOICES, MlaSettings, convert_to_mla
from dha_train.model_folders import check_model_folder, load_source_config, missing_tokenizer_note
from dha_train.models.head_map import HeadMap, HeadMapError, source_head_map
from dha_train.ops.deepseek import LATENT_NORM_FITS
from dha_train.ops.mla import BALANCES, PAIR_CRITERIA

MLA_FORMATS = ('dha_train', 'deepseek')
# Options of the project's MLA class that DeepSeek's format has no room for (one rank, one shared RoPE key).
_NOT_DEEPSEEK = ('pair_criterion', 'ranks', 'rank_step', 'factorisation')
# Options of DeepSeek's format only (the project's MLA class has no latent norm).
_DEEPSEEK_ONLY = ('latent_norm_fit', 'pin', 'quantizable_cache', 'choose_tokens')
# Every MLA option defaults to None here, so an option that does not apply is refused rather than ignored; the
# settings classes hold the defaults.
_MLA_SHARED = ('rope_pairs', 'freq_fold', 'balance', 'data', 'tokens', 'batch_size', 'seed', 'device')
_MLA_OPTIONS = ('cache_fraction', 'mla_format', *_MLA_SHARED, *_NOT_DEEPSEEK, *_DEEPSEEK_ONLY)


def _flag(name: str) -> str:
    return {'mla_format': '--format', 'pin': '--no-latent-pin'}.get(name, f"--{name.replace('_', '-')}")


def _given(args: argparse.Namespace, names) -> dict:
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('model_dir', help='local HF LLaMA folder (MHA or GQA)')
    parser.add_argument('out_dir')
    parser.add_argument('--method', choices=('mean_pool', 'mla'), default='mean_pool',
                        help='mean_pool: the GQA baseline (--head-map or --kv-heads); mla: multi-head latent '
                             'attention (--cache-fraction, see the MLA options)')
    target = parser.add_mutually_exclusive_group()
    target.add_argument('--head-map', default=None, help='a head_map.json')
    target.add_argument('--kv-heads', type=int, default=None,
                        help='this many K/V heads per layer, each the mean of a contiguous run of the source\'s '
                             'K/V heads (standard GQA when it divides them)')
    mla = parser.add_argument_group('MLA (--method mla)')
    defaults = MlaSettings(cache_fraction=1.0)
    mla.add_argument('--cache-fraction', type=float, default=None,
                     help='cache numbers per token as a fraction of the source\'s K+V cache (e.g. 0.3333)')
    mla.add_argument('--format', dest='mla_format', choices=MLA_FORMATS, default=None,
                     help='dha_train (default): the project\'s MLA class (per-layer ranks, RoPE pairs per K/V '
                          'head; loads with trust_remote_code); deepseek: transformers\' own DeepseekV3ForCausalLM '
                          '(one rank, one RoPE key shared by all heads), the format serving engines\' MLA kernels run')
    mla.add_argument('--rope-pairs', type=int, default=None,
                     help='RoPE pairs kept rotated: per K/V head (default: the rotated keys take 3/8 of the cached '
                          'numbers, 3/8 x fraction x head_dim pairs), or with --format deepseek in the shared RoPE key '
                          '(default: 5/8 of the head\'s pairs, the key at most a third of the cached numbers)')
    mla.add_argument('--pair-criterion', choices=PAIR_CRITERIA, default=None,
                     help=f'which pairs each K/V head keeps (default {defaults.pair_criterion}; not with deepseek, '
                          'whose pairs are strided)')
    mla.add_argument('--ranks', choices=RANK_CHOICES, default=None,
                     help=f'latent rank per layer: uniform, or allocated from the spectra (default '
                          f'{defaults.ranks}; deepseek has one rank)')
    mla.add_argument('--rank-step', type=int, default=None, help=f'default {defaults.rank_step}')
    mla.add_argument('--factorisation', choices=FACTORISATIONS, default=None,
                     help='activation: SVD whitened by the calibration covariance (default); weight: plain SVD')
    mla.add_argument('--latent-norm-fit', dest='latent_norm_fit', choices=LATENT_NORM_FITS, default=None,
                     help='deepseek: how the latent meets its RMSNorm: linear (the latent scaled into the norm\'s '
                          'linear range, where it is exact; default), regression (kv_b_proj fitted by least squares on '
                          'the normed latent over the calibration tokens) or scalar (the mean RMS)')
    mla.add_argument('--freq-fold', dest='freq_fold', type=int, default=None,
                     help='FreqFold. deepseek: this many consecutive slots of the shared RoPE key share one analysis '
                          'of every source pair their frequencies span (default 2). The MLA class: each K/V head\'s '
                          'pairs are cut into windows of this many, and a kept pair holds the top component of its '
                          'window (default: the widest windows that leave one per kept pair). 1: each kept pair is a '
                          'source pair as it is')
    mla.add_argument('--no-latent-pin', dest='pin', action='store_const', const=False, default=None,
                     help='deepseek, with --latent-norm-fit regression or scalar: no pin channel (by default, each '
                          'layer where it lowers the held-out error gets one latent channel that holds the latent\'s '
                          'RMS near-constant)')
    mla.add_argument('--quantizable-cache', dest='quantizable_cache', action=argparse.BooleanOptionalAction,
                     default=None,
                     help='deepseek: size the latent and the RoPE key in whole 32-value blocks (the budget rounded '
                          'down to whole blocks), so that llama.cpp can quantize the cache (-ctk q8_0 -ctv q8_0: half '
                          'the f16 bytes); the key nearest a quarter of the cached numbers, at stride 1. Default: '
                          'chosen with --balance by the loss on the val split of --data (see --choose-tokens)')
    mla.add_argument('--choose-tokens', dest='choose_tokens', type=int, default=None,
                     help=f'deepseek: where --quantizable-cache or --balance is not given, every candidate is built '
                          f'and the one of the lowest loss on this many tokens of the val split of --data is kept, '
                          f'its choice and every loss in the model card (default {DeepseekSettings.choose_tokens}; 0, '
                          f'or data with no val split: the fixed defaults, docs/methods/mla.md)')
    mla.add_argument('--balance', choices=BALANCES, default=None,
                     help=f'scale the keys against the values before the joint factorisation (default '
                          f'{defaults.balance}; deepseek: chosen, see --choose-tokens): energy (equal total energy '
                          'under the calibration covariance), feature_norm (TransMLA: equal mean per-feature norm) or '
                          'none')
    mla.add_argument('--data', default=None, help='`dha-train data prep` folder for calibration')
    mla.add_argument('--tokens', type=int, default=None, help=f'calibration tokens (default {defaults.tokens})')
    mla.add_argument('--batch-size', type=int, default=None, help=f'default {defaults.batch_size}')
    mla.add_argument('--seed', type=int, default=None, help=f'default {defaults.seed}')
    mla.add_argument('--device', default=None, help=f'default {defaults.device}')
    parser.add_argument('--overwrite', action='store_true')
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_model_folder(args.model_dir, who='convert')
    if args.method == 'mla':
        return run_mla(args)
    stray = [_flag(name) for name in _given(args, _MLA_OPTIONS)]
    if stray:
        raise ConfigError(f'convert --method mean_pool: {", ".join(stray)} apply only to --method mla')
    if args.head_map is None and args.kv_heads is None:
        raise ConfigError('convert --method mean_pool needs --head-map or --kv-heads')
    config = load_source_config(args.model_dir, who='convert')
    source = source_head_map(config, 'convert')
    if args.head_map is not None:
        head_map = HeadMap.load(args.head_map)
    else:
        try:
            head_map = HeadMap.pooled(source, args.kv_heads)
        except HeadMapError as exc:
            raise HeadMapError(f'--kv-heads {args.kv_heads}: {exc}') from exc
    out = convert_checkpoint(args.model_dir, args.out_dir, head_map, overwrite=args.overwrite)
    keys, values = head_map.kv_heads()[0]
    print(f'dha-train convert: wrote {out} ({keys} K + {values} V heads per layer'
          f'{"" if len(set(head_map.kv_heads())) == 1 else " in layer 0 (varies by layer)"}; '
          f'{head_map.budget_text(source)})')
    if note := missing_tokenizer_note(out, args.model_dir):
        print(note)
    return 0


def run_mla(args: argparse.Namespace) -> int:
    if args.head_map is not None or args.kv_heads is not None:
        raise ConfigError('convert --method mla takes --cache-fraction, not --head-map or --kv-heads')
    if args.cache_fraction is None:
        raise ConfigError('convert --method mla needs --cache-fraction (of the source\'s K+V cache)')
    if args.mla_format == 'deepseek':
        return run_deepseek(args)
    stray = [_flag(name) for name in _given(args, _DEEPSEEK_ONLY)]
    if stray:
        raise ConfigError(f'convert --method mla: {", ".join(stray)} apply only to --format deepseek')
    settings = MlaSettings(cache_fraction=args.cache_fraction, **_given(args, (*_MLA_SHARED, *_NOT_DEEPSEEK)))
    report = convert_to_mla(args.model_dir, args.out_dir, settings, overwrite=args.overwrite)
    ranks = report['ranks']
    print(f'dha-train convert --method mla: wrote {args.out_dir} (latent ranks {min(ranks)}-{max(ranks)}, '
          f'{report["rope_pairs"]} RoPE pairs per K/V head, fold {report["freq_fold"]} '
          f'({report["rope_energy_kept"]:.1%} of the key energy kept rotated); '
          f'{report["cache_values_per_token"]} cache numbers per '
          f'token: {report["fraction_of_source"]:.1%} of the source KV cache, {report["fraction_of_mha"]:.1%} of '
          'MHA\'s)')
    if note := missing_tokenizer_note(args.out_dir, args.model_dir):
        print(note)
    return 0


def run_deepseek(args: argparse.Namespace) -> int:
    given = [_flag(name) for name in _given(args, _NOT_DEEPSEEK)]
    if given:
        raise ConfigError(f'convert --format deepseek: {", ".join(given)} do not apply (one latent rank for every '
                          'layer, one RoPE key on strided pairs, the activation-aware factorisation)')
    settings = DeepseekSettings(cache_fraction=args.cache_fraction, **_given(args, (*_MLA_SHARED, *_DEEPSEEK_ONLY)))
    report = convert_to_deepseek(args.model_dir, args.out_dir, settings, overwrite=args.overwrite)
    pins = ('the latent in the norm\'s linear range' if settings.latent_norm_fit == 'linear' else
            f'a pin channel in {len(report["pinned_layers"])} of {len(report["layer_pin_errors"])} layers')
    print(f'dha-train convert --method mla --format deepseek: wrote {args.out_dir} (DeepseekV3ForCausalLM: '
          f'kv_lora_rank {report["kv_lora_rank"]}, a {report["qk_rope_head_dim"]}-dim RoPE key on pairs '
          f'{report["rope_pairs"]}, fold {report["freq_fold"]} ({report["rope_energy_kept"]:.1%} of the key energy '
          f'kept rotated), {pins}, {report["choice"]["chosen"]} ({_choice_text(report["choice"])}), '
          f'{report["cache_values_per_token"]} cache numbers per token: {report["fraction_of_source"]:.1%} of the '
          f'source KV cache, {report["fraction_of_mha"]:.1%} of MHA\'s, in an engine that caches the latent)')
    if note := missing_tokenizer_note(args.out_dir, args.model_dir):
        print(note)
    return 0


def _choice_text(choice: dict) -> str:
    if not choice.get('losses'):
        return choice['on']
    losses = ', '.join(f'{label} {loss:.4f}' for label, loss in choice['losses'].items())
    return f'chosen on {choice["on"]}: {losses}'
