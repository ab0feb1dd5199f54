"""The import contracts hold for dha_train, and the custom no-cycle contract does find a cycle when there is one."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import grimp
import pytest

from helpers import REPO

sys.path.insert(0, str(REPO))  # the contract module lives in tools/, beside the package
from tools.import_contracts import AcyclicContract  # noqa: E402


def _package(root, files: dict[str, str]) -> str:
    package = root / 'cyclepkg'
    package.mkdir()
    for name, source in files.items():
        (package / name).write_text(textwrap.dedent(source))
    return 'cyclepkg'


def _check(tmp_path, monkeypatch, files):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = _package(tmp_path, files)
    graph = grimp.build_graph(name, cache_dir=None)
    contract = AcyclicContract(name='no cycles', session_options={}, contract_options={'root': name})
    return contract.check(graph, verbose=False)


def test_the_acyclic_contract_reports_a_cycle_through_a_function_level_import(tmp_path, monkeypatch):
    check = _check(tmp_path, monkeypatch, {
        '__init__.py': '',
        'a.py': 'from cyclepkg import b\n',
        'b.py': 'def later():\n    from cyclepkg import c\n',
        'c.py': 'import cyclepkg.a\n',
        'd.py': 'import cyclepkg.a\n',
    })
    assert not check.kept
    assert [cycle['modules'] for cycle in check.metadata['cycles']] == [['cyclepkg.a', 'cyclepkg.b', 'cyclepkg.c']]


def test_the_acyclic_contract_keeps_a_tree(tmp_path, monkeypatch):
    check = _check(tmp_path, monkeypatch, {'__init__.py': '', 'a.py': 'from cyclepkg import b\n', 'b.py': ''})
    assert check.kept


@pytest.mark.parametrize('command', [['lint-imports'], ['ruff', 'check', 'dha_train', 'tests', 'tools']])
def test_the_tree_passes_its_linters(command):
    tool = str(REPO / '.venv' / 'bin' / command[0]) if (REPO / '.venv' / 'bin' / command[0]).exists() else command[0]
    done = subprocess.run([tool, *command[1:]], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
