"""RedPajama domains, their default sampling proportions, and how a file's domain is recognised."""

from __future__ import annotations

import re
from pathlib import Path

# Sampling proportions of the LLaMA-1 / RedPajama-1T mixture (Touvron et al. 2023, Table 1).
REDPAJAMA_PROPORTIONS: dict[str, float] = {
    'common_crawl': 0.67,
    'c4': 0.15,
    'github': 0.045,
    'book': 0.045,
    'wikipedia': 0.045,
    'arxiv': 0.025,
    'stackexchange': 0.02,
}
DOMAINS: tuple[str, ...] = tuple(sorted(REDPAJAMA_PROPORTIONS))

# A file-name prefix must be followed by a separator, so "c4-train.00001.jsonl" is c4 but "c4x.jsonl" is not.
_PREFIX = re.compile(r'^(' + '|'.join(sorted(DOMAINS, key=len, reverse=True)) + r')(?:[_\-.]|$)')


def domain_of(path: str | Path, root: str | Path | None = None) -> str | None:
    """The domain of a RedPajama file: the nearest enclosing folder named after a domain, else a file-name prefix.

    Folders above ``root`` are not looked at, so a data root that happens to sit under ``.../github/...`` does not
    turn every file into code. Returns None when neither rule applies.
    """
    path = Path(path)
    parts = path.parent.parts
    if root is not None and path.parent.resolve().is_relative_to(Path(root).resolve()):
        parts = path.parent.resolve().relative_to(Path(root).resolve()).parts
    for part in reversed(parts):
        if part in REDPAJAMA_PROPORTIONS:
            return part
    match = _PREFIX.match(path.name)
    return match.group(1) if match else None
