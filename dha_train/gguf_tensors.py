"""The tensors of an ``export-gguf`` file: a folder's safetensors read one tensor at a time and written under
llama.cpp's names, in the layouts its architecture reads (``dha_train.gguf_export`` says which architecture a folder
becomes; the family layer's ``LlamaCppLayout`` says how that architecture reads a file).

Per layer of an attention family (LLaMA, Mistral, Qwen2, Qwen3, Gemma 3, and the DHA class built on any of them):

- the query heads are taken in the order that makes the layer plain GQA (``servable_order``), folded into
  ``q_proj``'s rows and ``o_proj``'s columns, and K/V heads in the order the groups first read them;
- a NORM-RoPE architecture (``llama``, ``deci``) rotates adjacent pairs where HF rotates a head's two halves: Q and K
  rows (and their biases) are reordered per head (``rope_pairs_adjacent``); the NEOX ones (``qwen2``, ``qwen3``,
  ``gemma3``) rotate the halves as HF does and take the rows as they are;
- biases go in as ``attn_q.bias`` etc. (``o_proj``'s bias acts after the sum over heads and is not reordered);
- every norm the layout names, plus its ``norm_offset`` (Gemma's ``(1 + w)``: the file holds ``w + 1``, as
  llama.cpp's own converter writes it);
- where the engine applies a fixed softmax scale (``engine_attention_scale``: gemma3's ``1/sqrt(head_dim)``, which
  ignores ``query_pre_attn_scalar``), ``attn_q_norm`` is multiplied by the family's scale over the engine's: the
  query is normed, rotated (linear) and then scaled, so the product of the two is the family's scale, exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch

from dha_train import families
from dha_train.errors import DhaTrainError
from dha_train.model_folders import safetensors_files
from dha_train.models.head_map import HeadMap
from dha_train.ops.deepseek import latent_eps_scale, scale_latent_rows

# The MLA tensors that read the normed latent and the one that writes the latent (deepseek2): kept f16 in a q8_0
# file (see ``stored``).
LATENT_TENSORS = ('attn_k_b.weight', 'attn_v_b.weight', 'attn_kv_a_mqa.weight')
_PROJECTIONS = (('q_proj', 'attn_q'), ('k_proj', 'attn_k'), ('v_proj', 'attn_v'))


class GgufExportError(DhaTrainError, ValueError):
    """A folder no engine can serve as it is, or a file that would be overwritten: the message says which and why."""


class FolderWeights:
    """The folder's safetensors, read one tensor at a time (a 7B model is never held whole in float32)."""

    def __init__(self, folder: Path, stack: ExitStack):
        from safetensors import safe_open

        files = safetensors_files(folder)
        if not all((folder / name).is_file() for name in files):
            raise GgufExportError(f'export-gguf: {folder} holds no safetensors weights (pytorch_model.bin is not '
                                  'read: re-save the folder with safe_serialization=True)')
        self._where: dict[str, object] = {}
        for name in files:
            handle = stack.enter_context(safe_open(folder / name, framework='pt'))
            for key in handle.keys():
                self._where[key] = handle

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise GgufExportError(f'export-gguf: the weights have no {name}')
        return self._where[name].get_tensor(name).float()

    def names(self) -> list[str]:
        return list(self._where)


def rope_pairs_adjacent(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a Q or K projection (or its bias) with each head's halves (HF's ``rotate_half`` pairs i and i + d/2)
    reordered to adjacent pairs (llama.cpp's NORM RoPE pairs 2i and 2i + 1): row i + d/2 moves next to row i."""
    rows = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return rows.transpose(1, 2).reshape(weight.shape)


def _head_rows(weight: torch.Tensor, order: list[int]) -> torch.Tensor:
    """Rows grouped per head, the heads taken in ``order``."""
    return weight.reshape(len(order), -1, *weight.shape[1:])[order].reshape(weight.shape)


def first_use(mapping: list[int] | tuple[int, ...], order: list[int]) -> list[int]:
    """The compact heads in the order the query heads, taken in ``order``, first read them: the K (or V) rows'
    order that pairs compact head i with the i-th contiguous group."""
    seen: dict[int, None] = {}
    for head in order:
        seen.setdefault(int(mapping[head]), None)
    return list(seen)


def query_norm_scale(config) -> float:
    """What ``attn_q_norm`` is multiplied by so that the engine's fixed softmax scale becomes the family's."""
    family = families.of(config)
    engine = family.llama_cpp.engine_attention_scale
    return 1.0 if engine is None else family.attention_scale(config) / engine(config)


def attention_tensors(config, weights: FolderWeights, orders: list[list[int]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every layer's tensors of an attention family's architecture (see the module docstring)."""
    layout = families.of(config).llama_cpp
    head_map = HeadMap.from_hf_config(config)
    q_scale = query_norm_scale(config)
    for index, order in enumerate(orders):
        prefix, block, layer = f'model.layers.{index}.', f'blk.{index}.', head_map.layers[index]
        rows = {'q_proj': (order, config.num_attention_heads),
                'k_proj': (first_use(layer.key, order), layer.num_key_heads),
                'v_proj': (first_use(layer.value, order), None)}
        for projection, name in _PROJECTIONS:
            heads_order, rotated_heads = rows[projection]
            for kind in ('weight', 'bias'):
                key = f'{prefix}self_attn.{projection}.{kind}'
                if kind == 'bias' and key not in weights:
                    continue
                tensor = _head_rows(weights.get(key), heads_order)
                if layout.rope_pairs_adjacent and rotated_heads is not None:
                    tensor = rope_pairs_adjacent(tensor, rotated_heads)
                yield f'{block}{name}.{kind}', tensor
        output = weights.get(prefix + 'self_attn.o_proj.weight')
        yield block + 'attn_output.weight', _head_rows(output.T.contiguous(), order).T.contiguous()
        if prefix + 'self_attn.o_proj.bias' in weights:
            yield block + 'attn_output.bias', weights.get(prefix + 'self_attn.o_proj.bias')
        for hf_name, name in layout.norms:
            tensor = weights.get(f'{prefix}{hf_name}.weight') + layout.norm_offset
            if name in ('attn_q_norm', 'attn_k_norm') and layout.rope_pairs_adjacent:
                tensor = rope_pairs_adjacent(tensor, 1)
            if name == 'attn_q_norm':
                tensor = tensor * q_scale
            yield f'{block}{name}.weight', tensor
        yield from _mlp_tensors(weights, prefix, block)


def _mlp_tensors(weights: FolderWeights, prefix: str, block: str) -> Iterator[tuple[str, torch.Tensor]]:
    yield block + 'ffn_gate.weight', weights.get(prefix + 'mlp.gate_proj.weight')
    yield block + 'ffn_up.weight', weights.get(prefix + 'mlp.up_proj.weight')
    yield block + 'ffn_down.weight', weights.get(prefix + 'mlp.down_proj.weight')


def deepseek_tensors(config, weights: FolderWeights) -> Iterator[tuple[str, torch.Tensor]]:
    heads, rank = config.num_attention_heads, config.kv_lora_rank
    nope, value = config.qk_nope_head_dim, config.v_head_dim
    scale = latent_eps_scale(config.rms_norm_eps)
    for index in range(config.num_hidden_layers):
        prefix, block = f'model.layers.{index}.', f'blk.{index}.'
        down = scale_latent_rows(weights.get(prefix + 'self_attn.kv_a_proj_with_mqa.weight'), rank, scale)
        up = weights.get(prefix + 'self_attn.kv_b_proj.weight').reshape(heads, nope + value, rank)
        yield block + 'attn_norm.weight', weights.get(prefix + 'input_layernorm.weight')
        yield block + 'attn_q.weight', weights.get(prefix + 'self_attn.q_proj.weight')
        yield block + 'attn_kv_a_mqa.weight', down
        yield block + 'attn_kv_a_norm.weight', weights.get(prefix + 'self_attn.kv_a_layernorm.weight')
        # the engine absorbs k_b into the query (q_nope k_b^T . c) and applies v_b after attending the latent
        yield block + 'attn_k_b.weight', up[:, :nope].transpose(1, 2).contiguous()  # (heads, rank, nope)
        yield block + 'attn_v_b.weight', up[:, nope:].contiguous()  # (heads, value, rank)
        yield block + 'attn_output.weight', weights.get(prefix + 'self_attn.o_proj.weight')
        yield block + 'ffn_norm.weight', weights.get(prefix + 'post_attention_layernorm.weight')
        yield from _mlp_tensors(weights, prefix, block)


def llama3_rope_factors(config) -> torch.Tensor:
    """llama.cpp's ``rope_freqs``: per frequency, the default inverse frequency over the ``llama3``-scaled one
    (transformers' own RoPE initialisers compute both)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS['llama3'](config, 'cpu')
    default, _ = ROPE_INIT_FUNCTIONS['default'](config, 'cpu')
    return (default / scaled).float()


def stored(name: str, tensor: torch.Tensor, outtype: str) -> tuple[np.ndarray, object]:
    """(the array to write, its GGML type): norms and other 1-D tensors stay f32, as llama.cpp's converter keeps
    them; q8_0 falls back to f16 for rows not a multiple of its 32-value block, and for the MLA tensors that read
    the normed latent (``attn_k_b``, ``attn_v_b``): llama.cpp rounds a q8_0 matmul's input to 8-bit blocks too, and the
    DeepSeek-format latent can carry one large channel (the conversion's pin), which leaves the others a few levels.
    Measured on SmolLM2 at a third of the cache (8 held-out sequences): HF 4.498, all-q8_0 6.265, q8_0 with these two
    in f16 4.504. And for the tensor that writes the latent (``attn_kv_a_mqa``): a latent in the norm's linear range
    has rows of about 1e-5, where a q8_0 block's f16 scale (a 127th of the block's largest value) is subnormal and
    a few % off; on SmolLM2 at a third (the Rust book, 16 x 512 tokens, HF 3.8137): q8_0 3.8307, with it in f16
    3.8176."""
    import gguf
    from gguf.quants import quantize

    array = tensor.detach().cpu().float().numpy()
    kinds = {'f32': gguf.GGMLQuantizationType.F32, 'f16': gguf.GGMLQuantizationType.F16,
             'bf16': gguf.GGMLQuantizationType.BF16, 'q8_0': gguf.GGMLQuantizationType.Q8_0}
    kind = kinds[outtype]
    if array.ndim == 1 or name == 'rope_freqs.weight':
        kind = gguf.GGMLQuantizationType.F32
    elif kind == gguf.GGMLQuantizationType.Q8_0 and (array.shape[-1] % 32 or name.endswith(LATENT_TENSORS)):
        kind = gguf.GGMLQuantizationType.F16
    if kind == gguf.GGMLQuantizationType.F32:
        return array, kind
    if kind == gguf.GGMLQuantizationType.F16:
        return array.astype(np.float16), kind
    return quantize(array, kind), kind
