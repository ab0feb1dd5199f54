"""`dha-train bench gqa-memory`: what working on a GQA source's own K/V heads saves, at LLaMA-3-8B geometry.

Every method takes a GQA source's shared K/V heads as its units (``HeadMap.source_partitions``): nothing is expanded
to one K/V head per query head. This bench states what that saves for an 8B model without holding one:

1. **Parameters, on the meta device.** A LLaMA-3-8B-shaped model (32 layers, 32 query heads, 8 K/V heads, head
   dim 128, hidden 4096) is built on the meta device; DHA Fusion's surgery (``HeadFusion``, here to 4 K/V heads,
   groups of 2 source heads) runs on it, and the K/V and fusion parameter bytes are counted. The same is counted
   for the expanded path: the source turned into its MHA form (32 K/V heads per layer) before the surgery.
2. **Peak memory, measured.** One decoder layer of that shape is materialised on the CPU in a fresh process, with
   the surgery on either path, and one forward and backward over ``--tokens`` tokens runs; the process's
   high-water mark of resident memory (Linux ``VmHWM``) is read before the layer is built and after the step: the
   layer's weights, gradients, fused K/V weights and activations at their peak.

fp32 throughout (what training holds as master weights); Adam's two moments per parameter would add twice the
parameter bytes on top.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

LLAMA3_8B = {'vocab_size': 128256, 'hidden_size': 4096, 'intermediate_size': 14336, 'num_hidden_layers': 32,
             'num_attention_heads': 32, 'num_key_value_heads': 8, 'max_position_embeddings': 8192,
             'rope_theta': 500000.0}
TARGET_KV_HEADS = 4
PATHS = ('gqa_source', 'expanded_to_mha')
GIB = 2 ** 30


def _config(path: str, layers: int | None = None) -> LlamaConfig:
    settings = dict(LLAMA3_8B)
    if path == 'expanded_to_mha':
        settings['num_key_value_heads'] = settings['num_attention_heads']
    if layers is not None:
        settings['num_hidden_layers'] = layers
    return LlamaConfig(**settings, attn_implementation='sdpa')


def _fusion(config: LlamaConfig, tmp: Path):
    """HeadFusion to TARGET_KV_HEADS per layer, its map stated against ``config``'s own K/V heads (for the expanded
    path the same grouping of query heads: each expanded head joins its source head's group)."""
    from dha_train.algorithms.head_fusion import HeadFusion
    from dha_train.models.head_map import HeadMap

    source = HeadMap.gqa(config.num_hidden_layers, config.num_attention_heads, LLAMA3_8B['num_key_value_heads'],
                         config.head_dim)
    target = HeadMap.pooled(source, TARGET_KV_HEADS)
    return HeadFusion(head_map=str(target.save(tmp / f'map-{config.num_key_value_heads}.json')))


def count_parameters(tmp: Path) -> dict:
    """Parameter bytes (fp32) of the whole 8B-shaped model on the meta device, before and after the surgery."""
    rows = {}
    for path in PATHS:
        config = _config(path)
        with torch.device('meta'):
            model = LlamaForCausalLM(config)
        kv_before = sum(p.numel() for name, p in model.named_parameters() if 'k_proj' in name or 'v_proj' in name)
        fusion = _fusion(config, tmp)
        fusion.apply_surgery(model)
        total = sum(p.numel() for p in model.parameters())
        omega = sum(p.omega.numel() for pair in fusion.projections for p in pair)
        rows[path] = {'kv_weight_gib': 4 * kv_before / GIB, 'omega_gib': 4 * omega / GIB, 'model_gib': 4 * total / GIB}
    return rows


def _hwm_bytes() -> int:
    for line in Path('/proc/self/status').read_text().splitlines():
        if line.startswith('VmHWM:'):
            return int(line.split()[1]) * 1024
    raise RuntimeError('no VmHWM in /proc/self/status (Linux only)')


def measure_layer(path: str, tokens: int, tmp: Path) -> dict:
    """In this process: one 8B-shaped decoder layer with the fusion surgery, one forward and backward; the growth
    of the peak resident memory over the layer's build and step."""
    torch.manual_seed(0)
    before = _hwm_bytes()
    config = _config(path, layers=1)
    with torch.device('meta'):
        model = LlamaForCausalLM(config)
    layer = model.model.layers[0].to_empty(device='cpu')
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_(0.0, 0.02)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config, device='cpu')
    _fusion(config, tmp).apply_surgery(model)
    hidden = torch.randn(1, tokens, config.hidden_size, requires_grad=True)
    positions = torch.arange(tokens)[None]
    embeddings = model.model.rotary_emb(hidden, positions)
    output = layer(hidden, position_embeddings=embeddings, attention_mask=None, position_ids=positions)
    output = output[0] if isinstance(output, tuple) else output
    output.float().square().mean().backward()
    after = _hwm_bytes()
    parameters = sum(p.numel() for p in layer.parameters()) * 4
    return {'peak_growth_gib': (after - before) / GIB, 'layer_parameter_gib': parameters / GIB}


def run_gqa_memory_bench(out: str | Path | None = None, tokens: int = 2048) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory(prefix='dha-gqa-memory-') as scratch:
        scratch = Path(scratch)
        counts = count_parameters(scratch)
        measured = {}
        for path in PATHS:  # a fresh process each, so one path's peak does not hide the other's
            done = subprocess.run([sys.executable, '-c', 'import json, sys; from pathlib import Path; '
                                   'from dha_train.commands.bench.gqa_memory import measure_layer; '
                                   'print(json.dumps(measure_layer(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))))',
                                   path, str(tokens), str(scratch)], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f'bench gqa-memory: the {path} layer run failed:\n{done.stderr[-2000:]}')
            measured[path] = json.loads(done.stdout.strip().splitlines()[-1])
    layers = LLAMA3_8B['num_hidden_layers']
    result = {'config': LLAMA3_8B, 'target_kv_heads': TARGET_KV_HEADS, 'tokens': tokens, 'parameters': counts,
              'one_layer': measured,
              'peak_ratio_expanded_over_gqa': measured['expanded_to_mha']['peak_growth_gib']
              / measured['gqa_source']['peak_growth_gib']}
    print(f'LLaMA-3-8B shape ({layers} layers, 32 query / 8 K/V heads), DHA Fusion to {TARGET_KV_HEADS} K/V heads, fp32')
    print(f'{"path":<18} {"K/V weights GiB":>16} {"omega GiB":>10} {"model GiB":>10} {"layer params GiB":>17} '
          f'{"layer step peak GiB":>20}')
    for path in PATHS:
        row, layer = counts[path], measured[path]
        print(f'{path:<18} {row["kv_weight_gib"]:>16.2f} {row["omega_gib"]:>10.3f} {row["model_gib"]:>10.2f} '
              f'{layer["layer_parameter_gib"]:>17.3f} {layer["peak_growth_gib"]:>20.3f}')
    print(f'peak of one layer\'s forward+backward, expanded / GQA source: {result["peak_ratio_expanded_over_gqa"]:.2f}x')
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / 'results.json').write_text(json.dumps(result, indent=2))
    return result
