"""The support matrix (docs/families.md): for every family and every method or command, whether it runs, which
features of a checkpoint make it refuse, and why. Read from the family modules' ``features`` and ``refusals``, so
the docs page is checked against it (tests/test_family_matrix.py) and cannot drift."""

from __future__ import annotations

from dataclasses import dataclass

from dha_train.families import FAMILIES
from dha_train.families.base import COMMANDS, METHODS, Family

COLUMNS = METHODS + COMMANDS


@dataclass(frozen=True)
class Support:
    refused: str | None  # why every checkpoint of the family is refused (an ``always`` feature, or '*')
    conditional: tuple[tuple[str, str], ...]  # (feature, why) of refusals that depend on the checkpoint


def support(family: Family, column: str) -> Support:
    reasons = family.refusals.get(column, {})
    refused = next((f'{feature.name}: {reasons[feature.name]}' for feature in family.features
                    if feature.always and feature.name in reasons), None)
    if refused is None and '*' in reasons:
        refused = reasons['*']
    conditional = tuple((feature.name, reasons[feature.name]) for feature in family.features
                        if not feature.always and feature.name in reasons)
    return Support(refused, () if refused else conditional)


def matrix() -> dict[str, dict[str, Support]]:
    """{column: {model_type: Support}}."""
    return {column: {name: support(family, column) for name, family in FAMILIES.items()} for column in COLUMNS}
