"""Where the repository's recipes live (the package is installed editable from the repository)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
YAMLS = REPO_ROOT / 'yamls'


def recipe_path(name: str) -> Path:
    """``'pretrain/tiny.yaml'`` -> the file under the repository's ``yamls/``."""
    path = YAMLS / name
    if not path.is_file():
        raise FileNotFoundError(f'recipe {name} not found under {YAMLS}; install dha_train editable from its '
                                'repository (pip install -e .)')
    return path
