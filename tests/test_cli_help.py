"""`dha-train --help` names exactly the registry's methods, and each sub-command's help says what it does, with
the methods it takes by their registry names (no heavy import behind the top-level help)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from dha_train import methods
from dha_train.cli import COMMANDS, main


def _methods_named(text: str) -> set[str]:
    listed = re.search(r'Methods: (.*?)\.\s*(?:\n\s*\n|$)', text, re.S)
    assert listed, text
    return set(re.findall(r'(\w+) \(', ' '.join(listed.group(1).split())))


def test_the_top_level_help_names_every_registered_method_and_nothing_else(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(['--help'])
    assert exit_info.value.code == 0
    assert _methods_named(capsys.readouterr().out) == set(methods.names())


def test_the_top_level_help_imports_neither_transformers_nor_composer():
    code = ('import sys\nfrom dha_train.cli import main\ntry:\n    main(["--help"])\nexcept SystemExit:\n    pass\n'
            'print(sorted(m for m in ("transformers", "composer", "torch") if m in sys.modules))')
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == '[]'


@pytest.mark.parametrize('command, named', [
    ('convert', {'mean_pool', 'mla', 'mla_deepseek'}), ('refit', {'mean_pool', 'aligned_gqa', 'asym_gqa', 'dha', 'mla'}),
    ('align', {'aligned_gqa'}), ('search', {'dha', 'asym_gqa', 'mean_pool'}),
    ('export-gguf', {'mean_pool', 'aligned_gqa', 'asym_gqa', 'dha', 'mla_deepseek'}),
])
def test_the_sub_commands_that_take_methods_name_them_as_the_registry_does(command, named):
    help_text = COMMANDS[command][1]
    found = {name for name in methods.names() if re.search(rf'\b{name}\b', help_text)}
    assert found == named, (command, found)
    assert '->' in help_text  # input -> output


def test_every_sub_command_help_says_its_input_and_output():
    for command, (_, help_text) in COMMANDS.items():
        assert '->' in help_text or 'output' in help_text, command
