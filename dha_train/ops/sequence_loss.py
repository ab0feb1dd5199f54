"""Each packed sequence's mean next-token cross-entropy under a causal LM: the unit every held-out loss, its
interval and a conversion's choice among candidate settings read. Plain torch; the model is any callable returning
``.logits``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F


@torch.no_grad()
def mean_token_losses(model, sequences: Sequence[np.ndarray], batch_size: int = 8,
                      device: str | torch.device = 'cpu') -> list[float]:
    """One float per sequence (all of one length): the mean over its positions of the cross-entropy of the next
    token, in the order given."""
    values: list[float] = []
    for start in range(0, len(sequences), batch_size):
        batch = torch.as_tensor(np.stack(sequences[start:start + batch_size]).astype(np.int64), device=device)
        logits = model(input_ids=batch).logits[:, :-1].float()
        values += F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction='none').mean(dim=1).tolist()
    return values
