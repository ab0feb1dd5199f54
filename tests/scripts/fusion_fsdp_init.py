"""Run under `composer -n 2`: builds the platform's Trainer for a fusion recipe (HeadFusion surgery at INIT, then
FSDP2 sharding) and compares its logits with the unsharded MHA model built from the same seed. Rank 0 writes the
largest absolute logit difference to the JSON file given as the second argument."""

import json
import sys

import torch


def main(recipe: str, out: str) -> None:
    from composer.utils import dist, reproducibility

    from dha_train.algorithms.head_fusion import HeadFusion
    from dha_train.builders import build_model
    from dha_train.config import load_config
    from dha_train.models.fusion import FusedProjection
    from dha_train.train import build_trainer

    config = load_config(recipe)
    trainer = build_trainer(config)
    reproducibility.seed_all(config.seed)  # the seed build_trainer used: the same initial MHA weights
    reference = build_model(config.model).eval()
    sharded = trainer.state.model.model.eval()
    fused = [m for m in sharded.modules() if isinstance(m, FusedProjection)]
    ids = torch.randint(0, config.model.config['vocab_size'], (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = sharded(input_ids=ids).logits
        want = reference(input_ids=ids).logits
    fusion = next(a for a in trainer.state.algorithms if isinstance(a, HeadFusion))
    result = {'max_abs_diff': float((got - want).abs().max()), 'fused_projections': len(fused),
              'world_size': dist.get_world_size(), 'fsdp': type(sharded).__name__,
              'omega_is_sharded': type(fused[0].omega).__name__, 'fusion_loss': float(fusion.fusion_loss())}
    if dist.get_global_rank() == 0:
        with open(out, 'w') as handle:
            json.dump(result, handle)
    trainer.close()


if __name__ == '__main__':
    main(sys.argv[1], sys.argv[2])
