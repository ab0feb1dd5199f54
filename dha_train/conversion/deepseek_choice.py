"""The DeepSeek-format conversion's choice of split and balance on the user's own data.

A default chosen on one text does not hold on another: issue 47's quantizable split with the feature-norm balance
won on vim's help and lost 0.41 nats a token on a text of another kind. So, where the user gives neither
``--quantizable-cache`` nor ``--balance``, `convert` builds each candidate from the one calibration pass and keeps the
one with the lowest loss on the first ``choose_tokens`` tokens of the val split of the calibration data (never
calibrated on), and the model card records every candidate's loss. Without a val split, or with ``choose_tokens``
0, the fixed default holds (``FIXED``), chosen across several texts of different kinds (docs/methods/mla.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dha_train.data.loaders import split_sequences
from dha_train.data.prep import read_manifest

CHOICE_TOKENS = 8192  # of the val split, taken round-robin over its domains


@dataclass(frozen=True)
class Candidate:
    quantizable_cache: bool  # the latent and the key in whole 32-value blocks (the key at stride 1)
    balance: str

    @property
    def label(self) -> str:
        return f"{'quantizable' if self.quantizable_cache else 'unrounded'} split, {self.balance} balance"


# the fixed default balance up to a third of the source's cache, and above it (deepseek.fixed_candidate)
FIXED_BALANCES = ('feature_norm', 'energy')
CANDIDATE_BALANCES = ('feature_norm', 'energy')


def candidates(quantizable_cache: bool | None, balance: str | None, quantizable_fits: bool) -> list[Candidate]:
    """The settings to choose among: every split the budget allows unless one was asked for, times every candidate
    balance unless one was asked for."""
    splits = [quantizable_cache] if quantizable_cache is not None else ([True, False] if quantizable_fits else [False])
    balances = [balance] if balance is not None else list(CANDIDATE_BALANCES)
    return [Candidate(split, name) for split in splits for name in balances]


def choice_sequences(data: str, tokens: int) -> list[np.ndarray]:
    """The first sequences of each domain's val split, taken in turn until ``tokens``; [] when the data has no val
    split or ``tokens`` is 0."""
    if tokens < 1:
        return []
    per_domain = []
    for domain in sorted(read_manifest(str(data))['domains']):
        try:
            per_domain.append(split_sequences(data, domain, 'val'))
        except FileNotFoundError:
            continue  # a domain with no val split
    chosen, count, index = [], 0, 0
    while count < tokens and any(index < len(sequences) for sequences in per_domain):
        for sequences in per_domain:
            if index < len(sequences) and count < tokens:
                chosen.append(sequences[index])
                count += len(sequences[index])
        index += 1
    return chosen

