"""`convert --format deepseek` chooses its split and balance on the val split of the calibration data: every
candidate is built from one calibration pass, the one of the lowest loss is the folder written, and the card says
so (issue 62, item 8)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dha_train.conversion.deepseek import DeepseekSettings, convert_to_deepseek
from dha_train.conversion.deepseek_choice import Candidate, candidates, choice_sequences
from dha_train.model_card import read_model_card
from dha_train.ops.sequence_loss import mean_token_losses


@pytest.fixture(scope='module')
def smol_shaped(tmp_path_factory, tokenizer_dir):
    """SmolLM2-135M's attention (9 query heads, 3 K/V heads of 64), one layer: a third of its cache (128 numbers a
    token) holds a quantizable split (96 + 32) and an unrounded one (88 + 40)."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp('smol-shaped')
    LlamaForCausalLM(LlamaConfig(vocab_size=384, hidden_size=576, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=9, num_key_value_heads=3,
                                 max_position_embeddings=256)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


def _settings(data_root, **given) -> DeepseekSettings:
    return DeepseekSettings(cache_fraction=1 / 3, data=str(data_root), tokens=256, sample_tokens=128, batch_size=2,
                            **{'choose_tokens': 512, **given})


def test_the_folder_written_is_the_candidate_of_the_lowest_val_loss(smol_shaped, data_root, tmp_path):
    report = convert_to_deepseek(smol_shaped, tmp_path / 'out', _settings(data_root))
    losses = report['choice']['losses']
    assert set(losses) == {c.label for c in candidates(None, None, quantizable_fits=True)}  # 2 splits x 2 balances
    assert len(set(losses.values())) == 4  # the candidates are different models
    best = min(losses, key=losses.get)
    assert report['choice']['chosen'] == best
    assert (report['quantizable_cache'], report['balance']) == (best.startswith('quantizable'), best.split(', ')[1]
                                                                .removesuffix(' balance'))
    # the saved folder scores the chosen candidate's loss on the same sequences
    model = AutoModelForCausalLM.from_pretrained(tmp_path / 'out').eval()
    values = mean_token_losses(model, choice_sequences(str(data_root), 512))
    assert sum(values) / len(values) == pytest.approx(losses[best], rel=1e-5)
    card = read_model_card(tmp_path / 'out')[0]['dha_train']['stages'][-1]
    assert card['split_and_balance']['chosen'] == best and card['split_and_balance']['losses'] == pytest.approx(losses)


def test_what_is_asked_is_not_chosen_and_no_choice_keeps_the_fixed_defaults(smol_shaped, data_root, tmp_path):
    asked = convert_to_deepseek(smol_shaped, tmp_path / 'asked', _settings(data_root, balance='energy'))
    assert set(asked['choice']['losses']) == {'quantizable split, energy balance', 'unrounded split, energy balance'}
    fixed = convert_to_deepseek(smol_shaped, tmp_path / 'fixed', _settings(data_root, choose_tokens=0))
    assert 'losses' not in fixed['choice'] and '--choose-tokens 0' in fixed['choice']['on']
    default = Candidate(fixed['quantizable_cache'], fixed['balance'])
    assert fixed['choice']['chosen'] == default.label


def test_the_choice_reads_the_val_split_round_robin_over_domains(data_root):
    sequences = choice_sequences(str(data_root), 3 * 64)
    assert sum(map(len, sequences)) >= 3 * 64 and len(sequences) >= 2
    assert choice_sequences(str(data_root), 0) == []
