"""`dha-train import-gguf` on every family's architecture: a tiny model of each family (transformers' own classes,
with biases, q/k norms, LLaMA-3.x RoPE scaling, Gemma 3's sliding/full layers, window, local RoPE theta and own
attention scale), written by `export-gguf` in float32 and imported again, is its family's class with the source's
logits to float tolerance and its tokenizer. What transformers' GGUF reading leaves out, and the import restores,
is named in import_gguf.json: the llama3 scaling (rope_freqs), Gemma 3's layer pattern, local theta and scale, a
'llama' file named 'mistral', and qwen3, which transformers 4.53's GGUF loader does not read at all."""

from __future__ import annotations

import json

import pytest
import torch
from family_models import FAMILY_NAMES, logits_of, save_tiny_family_model, tiny_model

from dha_train import families
from dha_train.cli import main as cli_main
from dha_train.gguf_import import PROVENANCE_FILE
from helpers import mixed_text_lines

pytest.importorskip('gguf')

# what each family's file needs restored (the folder, and so the file's general.name, is the model type)
CORRECTED = {
    'llama': {'rope_scaling'},
    'mistral': {'model_type', 'tokenizer'},  # general.name 'mistral': transformers reads the file as Mistral
    'qwen2': set(),
    'qwen3': {'config', 'tokenizer'},
    'gemma3_text': {'layer_types', 'rope_local_base_freq', 'query_pre_attn_scalar', 'tokenizer'},
}


@pytest.mark.parametrize('model_type', FAMILY_NAMES)
def test_a_tiny_model_exported_and_imported_is_its_family_with_its_logits(model_type, tmp_path, tokenizer_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = save_tiny_family_model(tmp_path / model_type, model_type, tokenizer_dir)
    file = tmp_path / f'{model_type}.gguf'
    assert cli_main(['export-gguf', str(source), str(file), '--outtype', 'f32']) == 0
    out = tmp_path / 'imported'
    assert cli_main(['import-gguf', str(file), str(out)]) == 0

    family = families.get(model_type if model_type != 'mistral' else 'llama')  # a 'llama' file is LLaMA
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, torch_dtype=torch.float32).eval()
    assert type(model) is family.causal_lm_class
    torch.testing.assert_close(logits_of(model), logits_of(tiny_model(model_type)), atol=2e-5, rtol=0)

    provenance = json.loads((out / PROVENANCE_FILE).read_text())
    assert provenance['family'] == family.model_type and provenance['quantization'] == 'ALL_F32'
    assert set(provenance['corrections']) == CORRECTED[model_type]
    if model_type == 'gemma3_text':
        config = model.config
        assert config.layer_types == ['sliding_attention', 'full_attention'] and config.sliding_window == 6
        assert (config.rope_local_base_freq, config.query_pre_attn_scalar) == (100.0, 16)  # llama.cpp's scale

    tokenizer, expected = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(tokenizer_dir)
    lines = mixed_text_lines()[::7]
    assert [line for line in lines if tokenizer(line, add_special_tokens=False).input_ids !=
            expected(line, add_special_tokens=False).input_ids] == []


@pytest.mark.parametrize('pre', ['gpt-2', 'smollm', 'llama-bpe', 'qwen2'])
def test_a_byte_level_vocabulary_transformers_cannot_read_is_rebuilt_as_llama_cpp_splits_it(pre, tmp_path):
    """A qwen3 file (transformers 4.53 has no reader for it) with each byte-level pre-tokenizer llama.cpp names:
    the imported tokenizer gives llama.cpp's ids on every line of mixed text (digits, code, non-ASCII). The
    vocabulary is trained on whole lines (no split before BPE), so its merges cross every boundary a pre-tokenizer
    draws: a split that differs from llama.cpp's shows."""
    import gguf
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from dha_train.engine_process import EngineProcess
    from dha_train.gguf_vocab import LLAMA3_REGEX, QWEN2_REGEX
    from dha_train.llama_cpp_engine import LlamaCppModel

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bytes_only = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    shapes = {'gpt-2': [byte_level], 'smollm': [pre_tokenizers.Digits(individual_digits=True), byte_level],
              'llama-bpe': [pre_tokenizers.Split(Regex(LLAMA3_REGEX), 'isolated'), bytes_only],
              'qwen2': [pre_tokenizers.Split(Regex(QWEN2_REGEX), 'isolated'), bytes_only]}
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer, backend.decoder = bytes_only, decoders.ByteLevel()
    lines = mixed_text_lines()
    backend.train_from_iterator(lines * 4, trainers.BpeTrainer(vocab_size=1024, min_frequency=2, show_progress=False,
                                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    backend.pre_tokenizer = pre_tokenizers.Sequence(shapes[pre])
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(tmp_path / 'tokenizer')
    source = save_tiny_family_model(tmp_path / 'qwen3', 'qwen3', tmp_path / 'tokenizer', vocab_size=1024)
    file = tmp_path / 'qwen3.gguf'
    assert cli_main(['export-gguf', str(source), str(file), '--outtype', 'f32']) == 0
    assert gguf.GGUFReader(file).fields['tokenizer.ggml.pre'].contents() == pre
    assert cli_main(['import-gguf', str(file), str(tmp_path / 'imported')]) == 0

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / 'imported')
    with EngineProcess(LlamaCppModel, file, vocab_only=True) as engine:
        assert [line for line in lines
                if engine.tokenize(line) != tokenizer(line, add_special_tokens=False).input_ids] == []
