"""What a user of an exported folder sees, in whichever transformers runs this file: its tokenizer's ids for a few
prompts, the logits and eager attention weights of those prompts, greedy ``generate`` with the KV cache (dynamic, and
static where the model allows one), uncached argmax decoding, and the KV heads the cache holds per layer.

It imports torch and transformers only, so it also runs as a script where dha_train cannot be imported
(test_export_transformers5.py runs it under transformers 5.x): ``python export_probe.py FOLDERS PROMPTS NEW_TOKENS
OUT`` with FOLDERS a JSON {name: folder}, PROMPTS a JSON list; OUT gets ``torch.save`` of {name: probe} plus the
``environment`` it ran in.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer


def generation_positions(mask: torch.Tensor) -> torch.Tensor:
    """The position ids generate gives a left-padded batch: real tokens count from 0, padding gets 1."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


@torch.no_grad()
def argmax_decode(model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding that reruns the whole sequence for every token (no cache)."""
    for _ in range(new_tokens):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=generation_positions(mask),
                       use_cache=False).logits
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
    return ids


@torch.no_grad()
def probe(folder: str, prompts: list[str], new_tokens: int) -> dict:
    # transformers 5.x reads the folder's config (with its auto_map) to pick the tokenizer class, and without
    # trust_remote_code asks on stdin whether to run the modeling file.
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side='left', trust_remote_code=True)
    batch = tokenizer(prompts, return_tensors='pt', padding=True)
    ids, mask = batch['input_ids'], batch['attention_mask']
    real = mask.bool()  # padded positions attend to nothing, so their outputs are no one's business

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=generation_positions(mask),
                   use_cache=False).logits
    generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                               use_cache=True, return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)

    try:  # a preallocated cache: fine for uniform heads, refused by DHA's per-layer head counts
        static = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                cache_implementation='static', pad_token_id=tokenizer.pad_token_id)
    except ValueError as error:
        static = str(error)

    eager = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, attn_implementation='eager').eval()
    attentions = eager(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    return {
        'model_class': f'{type(model).__module__}.{type(model).__name__}',
        'input_ids': ids,
        'logits': logits[real],
        'attentions': [layer.transpose(1, 2)[real] for layer in attentions],  # (real tokens, heads, keys)
        'sequences': generated.sequences,
        'argmax_sequences': argmax_decode(model, ids, mask, new_tokens),
        'cache_heads': [(key.shape[1], value.shape[1]) for key, value, *_ in generated.past_key_values],
        'static_cache_sequences': static,  # or the error that refused a static cache
    }


def main(argv: list[str]) -> None:
    folders, prompts, new_tokens, out = json.loads(argv[0]), json.loads(argv[1]), int(argv[2]), argv[3]
    results = {name: probe(folder, prompts, new_tokens) for name, folder in folders.items()}
    results['environment'] = {'transformers': transformers.__version__, 'transformers_file': transformers.__file__,
                              'torch_file': torch.__file__,
                              'dha_train_importable': importlib.util.find_spec('dha_train') is not None}
    torch.save(results, out)


if __name__ == '__main__':
    main(sys.argv[1:])
