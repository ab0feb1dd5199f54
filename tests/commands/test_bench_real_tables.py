"""`dha-train bench real-tables`: what each headline row says its model went through."""

from __future__ import annotations

import pytest

from dha_train.commands.bench.real.tables import _headline_stage


@pytest.mark.parametrize('label, method, stage', [
    ('mean-pool kv1 +KL', 'mean_pool', 'healed (refit, transfer, KL)'),
    ('mean-pool kv2 +CT', 'mean_pool', 'CT'),
    ('DHA kv2 post-fusion', 'dha', 'Fusion'),
    ('DHA kv2 +CT', 'dha', 'Fusion + CT'),
    ('aligned GQA kv1 +prune', 'aligned_gqa', 'L0 pruning + distillation'),
    # MoH pools no K/V head, so its healing has no refit
    ('MoH 7/9 +KL', 'moh', 'healed (transfer, KL), 7/9 heads active'),
    ('MoH 7/9 +CT', 'moh', 'CT, 7/9 heads active'),
])
def test_each_headline_row_names_the_stages_its_model_went_through(label, method, stage):
    assert _headline_stage({'label': label, 'method': method}) == stage
