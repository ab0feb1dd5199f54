"""docs/families.md's support matrix is the family layer's (``dha_train.families.matrix``): every cell is either a
tick, shown by the row's test (which runs over the families), or the one-line refusal the family module states.
Run ``python tests/test_family_matrix.py`` to print the block after changing a family module."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from dha_train import families
from dha_train.families.matrix import COLUMNS, matrix

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / 'docs' / 'families.md'
BEGIN, END = '<!-- support matrix: begin -->', '<!-- support matrix: end -->'

# The test that shows each method or command working, over the families it does not refuse.
SHOWN_BY = {
    'mean_pool': 'tests/test_families.py::test_mean_pool_of_copied_heads_is_the_source_in_its_own_class',
    'asym_gqa': 'tests/test_families_dha.py::test_head_searches_run_on_every_family_and_find_the_copied_heads',
    'dha': 'tests/test_families_dha.py::test_fusion_starts_at_the_source_and_bakes_to_the_fused_model_with_its_biases',
    'aligned_gqa': 'tests/test_families.py::test_aligned_gqa_fold_and_permute_keep_the_source_function_and_class',
    'moh': 'tests/test_families_healing.py::test_moh_surgery_keeping_every_head_is_the_source_in_its_family_decoder',
    'mla': 'tests/test_families_mla.py::test_convert_at_the_whole_budget_saves_a_folder_that_loads_as_the_source',
    'mla_deepseek': 'tests/test_families_mla.py::test_a_mistral_source_in_deepseeks_format_is_the_source_at_full_rank',
    'refit': 'tests/test_families_healing.py::test_refit_of_a_lossless_conversion_stays_lossless',
    'attention_transfer': 'tests/test_families_healing.py::test_attention_transfer_of_the_source_itself_costs_nothing',
    'eval': 'tests/test_families.py::test_eval_and_plan_run_on_each_family',
    'export': 'tests/test_families.py::test_a_healed_export_of_each_family_is_its_own_class_and_trained',
    'export_gguf': 'tests/commands/test_export_gguf_families.py::'
                   'test_each_family_runs_in_its_own_llama_cpp_architecture_as_in_transformers',
    'import_gguf': 'tests/commands/test_import_gguf_families.py::'
                   'test_a_tiny_model_exported_and_imported_is_its_family_with_its_logits',
    'plan': 'tests/test_families.py::test_eval_and_plan_run_on_each_family',
}
# The tests that show the refusals fire from the command, in one line, writing nothing.
REFUSALS_SHOWN_BY = {
    'aligned_gqa': 'tests/test_families.py::test_aligned_gqa_refuses_per_head_norms_in_one_line',
    'mla_deepseek': 'tests/test_families_mla.py::test_deepseek_format_refuses_a_feature_its_decoder_cannot_carry_in_one_line',
    'export_gguf': 'tests/commands/test_export_gguf_families.py::test_what_llama_cpp_cannot_run_as_transformers_does_is_refused',
}


def rendered() -> str:
    table = matrix()
    names = list(families.FAMILIES)
    lines = ['| method or command | ' + ' | '.join(families.get(n).label for n in names) + ' | shown by |',
             '| --- |' + ' --- |' * (len(names) + 1)]
    reasons = []
    for column in COLUMNS:
        cells = []
        for name in names:
            support = table[column][name]
            if support.refused:
                cells.append('refused (1)'.replace('1', str(len(reasons) + 1)))
                reasons.append(f'{families.get(name).label}, `{column}`: {support.refused}')
            elif support.conditional:
                marks = []
                for feature, why in support.conditional:
                    reasons.append(f'{families.get(name).label}, `{column}`, with {feature}: {why}')
                    marks.append(str(len(reasons)))
                cells.append(f"yes, not with ({', '.join(marks)})")
            else:
                cells.append('yes')
        lines.append(f'| `{column}` | ' + ' | '.join(cells) + f' | `{SHOWN_BY[column]}` |')
    lines += ['', 'Refusals, each one line from the command (exit 2, nothing written):', '']
    lines += [f'{index}. {text}' for index, text in enumerate(reasons, 1)]
    lines += ['', 'The refusals are shown by ' + ', '.join(f'`{test}`' for test in REFUSALS_SHOWN_BY.values()) + '.']
    return '\n'.join(lines)


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith('test_')}


def test_the_docs_matrix_is_the_family_layers():
    text = PAGE.read_text()
    assert BEGIN in text and END in text
    block = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert block == rendered(), 'docs/families.md is out of date: run python tests/test_family_matrix.py'


def test_every_cell_names_a_test_that_exists():
    for test in {**SHOWN_BY, **REFUSALS_SHOWN_BY}.values():
        file, name = test.split('::')
        assert name in _test_names(REPO / file), test
    assert set(SHOWN_BY) == set(COLUMNS)


def test_every_refusal_names_a_feature_its_family_has():
    for family in families.FAMILIES.values():
        names = {feature.name for feature in family.features}
        for column, reasons in family.refusals.items():
            assert column in COLUMNS, (family.model_type, column)
            assert set(reasons) - {'*'} <= names, (family.model_type, column, set(reasons) - names)


if __name__ == '__main__':
    sys.stdout.write(rendered() + '\n')
