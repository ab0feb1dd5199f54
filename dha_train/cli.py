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

# The conversion methods, as the method registry names them (dha_train.methods; tests/test_cli_help.py holds the two
# equal). Spelled out here because `dha-train --help` must not import the registry (it imports transformers).
METHODS = {'mean_pool': 'GQA baseline', 'aligned_gqa': 'aligned GQA', 'asym_gqa': 'AsymGQA', 'dha': 'DHA',
           'moh': 'MoH', 'mla': 'MLA', 'mla_deepseek': "MLA in DeepSeek's format"}

# sub-command -> (module under dha_train.commands, one-line help: what it does, the methods it takes, its input and
# its output)
COMMANDS: dict[str, tuple[str, str]] = {
    'quickstart': ('quickstart', 'the main job on the embedded data: a stdlib corpus, a tokenizer, a tiny MHA LLaMA, '
                   'then dha and mean_pool at a 25% KV budget; input: nothing; output: quickstart_run/ and a table'),
    'data': ('data_prep', 'data prep: RedPajama-style JSONL -> tokenized MDS shards per domain; data verify: the '
             'shards against their recorded hashes; data corpus: the local stdlib as RedPajama JSONL (no download)'),
    'train': ('train', 'every method\'s stages: a YAML recipe (yamls/<method>/) -> Composer checkpoints in its '
              'save folder (`composer -n N -m dha_train.train` for several processes)'),
    'plan': ('plan', 'a recipe (any method) -> per-rank peak memory, fit on a GPU, FLOPs and wall time, worked out '
             'on this CPU with fake tensors (no weights or data)'),
    'export': ('export', 'a Composer checkpoint of any method -> a Hugging Face folder (the method\'s model class)'),
    'eval': ('evaluate', 'lm-evaluation-harness (and held-out loss) on an HF folder or checkpoint of any method -> '
             'eval_results.json'),
    'local-task': ('local_task', "a corpus folder (the quickstart's corpus/) -> the offline multiple-choice lm-eval "
                   'task'),
    'compare': ('compare', 'eval_results.json of several runs -> a table and one plot'),
    'search': ('search', 'dha, asym_gqa and mean_pool head maps: an MHA or GQA folder plus calibration data -> '
               'head_map.json and analysis plots (neighbour, similarity or AsymGQA search)'),
    'align': ('align', 'aligned_gqa: an MHA or GQA folder plus calibration data -> an HF folder with the alignment '
              'folded into the weights and heads permuted into contiguous groups'),
    'convert': ('convert', 'mean_pool (the GQA baseline: K/V heads mean-pooled by a head map), mla (the MLA class) or '
                "mla_deepseek (--format deepseek: transformers' DeepseekV3): an MHA or GQA HF folder -> an HF folder"),
    'refit': ('refit', 'the first healing step for mean_pool, aligned_gqa, asym_gqa, dha and mla: a converted HF '
              'folder and its source -> an HF folder refitted in closed form from calibration statistics'),
    'import-gguf': ('import_gguf', 'a GGUF file of a supported family (llama, qwen2, qwen3, gemma3; or smollm2-135m, '
                    'gemma3-270m, the bundled ones) -> a Hugging Face folder of its de-quantised float32 weights '
                    'and tokenizer'),
    'export-gguf': ('export_gguf', 'a plain or GQA model of any family, a servable DHA/AsymGQA (mean_pool, aligned_gqa, asym_gqa, dha) '
                    "or mla_deepseek HF folder -> one GGUF file that llama.cpp (llama-server, ollama) serves with its "
                    'smaller cache'),
    'bench': ('bench', 'benchmarks of the methods (throughput, conversion, moh, search, load, gqa-memory, mla, '
              'decode, real, serve) -> a printed table and results.json'),
}


def _chosen(argv: list[str]) -> str | None:
    """The sub-command named in ``argv`` (its first word that is not an option), if any."""
    return next((word for word in argv if not word.startswith('-')), None)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser, with the arguments of the sub-command ``argv`` names (the others are listed by name only)."""
    methods = ', '.join(f'{name} ({label})' for name, label in METHODS.items())
    parser = argparse.ArgumentParser(prog='dha-train', description='Convert LLaMA checkpoints (MHA or GQA) into '
                                     f'cheaper attention and train them back, on Composer. Methods: {methods}.')
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
