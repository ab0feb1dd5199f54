"""Composer checkpoint (full file or sharded folder) -> Hugging Face folder (safetensors, config, tokenizer).

Method-agnostic: the checkpoint's config names the method whose surgery it holds, and ``methods.export_model``
turns it into the model that method stands for.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import dha_train.models  # noqa: F401  (registers the DHA and MoH classes so every exported config resolves)
from dha_train.checkpoints import CheckpointError, load_composer_state, resolve_checkpoint
from dha_train.data.tokenizer import load_tokenizer
from dha_train.methods import MethodError, export_model, method_of
from dha_train.model_card import card_stage, read_run_record, write_model_card
from dha_train.models.head_map import HEAD_MAP_FILE, HeadMap
from dha_train.paths import check_writable, refuse_nonempty, staged_folder
from dha_train.tokenizer_files import load_tokenizer_folder
from dha_train.untrusted import UntrustedDataError, config_from_dict, write_tokenizer_entries
from dha_train.weight_sizes import check_parameter_budget


def _hf_parts(state: dict, checkpoint: Path):
    """The HF config and tokenizer a checkpoint carries, built only through ``dha_train.untrusted``: the config from
    the allowed model types with no code keys, the tokenizer files under allowed base names in a folder of our own
    (Composer's own restore would write each file under the name the checkpoint gives and take the config's
    ``_name_or_path`` and ``trust_remote_code``)."""
    try:
        hf_state = state['state']['integrations']['huggingface']
        config_dict = dict(hf_state['model']['config']['content'])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f'{checkpoint} has no Hugging Face metadata; was it written by `dha-train train`?') from exc
    where = f'{checkpoint} (its Hugging Face config)'
    if isinstance(config_dict.get('id2label'), dict):  # JSON turned its integer keys into strings
        try:
            config_dict['id2label'] = {int(key): value for key, value in config_dict['id2label'].items()}
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f'{where}: id2label has a key that is not an integer') from exc
    try:
        config = config_from_dict(config_dict, where=where)
        entries = hf_state.get('tokenizer') if isinstance(hf_state, dict) else None
        if not entries:
            return config, None
        with tempfile.TemporaryDirectory(prefix='dha-tokenizer-') as tmp:
            write_tokenizer_entries(entries, tmp, f'{checkpoint}')
            try:
                tokenizer = load_tokenizer_folder(tmp, f'{checkpoint} (its tokenizer)', config=config)
            except UntrustedDataError:
                raise
            except Exception as exc:  # transformers raises many types for a broken tokenizer file
                lines = str(exc).strip().splitlines()
                raise CheckpointError(f"{checkpoint}: its tokenizer does not load ({type(exc).__name__}: "
                                      f"{lines[0][:200] if lines else ''})") from exc
    except UntrustedDataError as exc:
        raise CheckpointError(str(exc)) from None
    return config, tokenizer


def model_weights(state: dict) -> dict:
    """The HF model's weights: Composer's wrapper prefixes every key with ``model.``."""
    prefix = 'model.'
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state['state']['model'].items()}


def _trained_tokens(state: dict) -> int:
    """Tokens the run trained on, from Composer's timestamp in the checkpoint."""
    timestamp = state['state'].get('timestamp') or {}
    timestamp = timestamp.get('Timestamp', timestamp)  # Composer saves {'Timestamp': {...}}
    return int(timestamp.get('token', 0) or 0)


def export_hf(checkpoint: str | Path, out_dir: str | Path, *, tokenizer: str | Path | None = None,
              dtype: str = 'float32', overwrite: bool = False, start: str | Path | None = None) -> Path:
    """Write ``out_dir`` as a HF model folder loadable with ``AutoModelForCausalLM.from_pretrained``. ``start``: the
    folder the run started from, whose card the export's continues (default: the run record's, when it lies beside
    the save folder; ``model_card.read_run_record``)."""
    out_dir = Path(out_dir)
    refuse_nonempty(out_dir, overwrite)  # fail before loading the checkpoint
    check_writable(out_dir, staged=True)
    if dtype not in ('float32', 'bfloat16', 'float16'):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got '{dtype}'")
    path = resolve_checkpoint(checkpoint)
    state = load_composer_state(path)
    config, saved_tokenizer = _hf_parts(state, path)
    hf_tokenizer = load_tokenizer(tokenizer) if tokenizer is not None else saved_tokenizer

    tagged = method_of(config)  # read before the export drops the tag
    record, start = read_run_record(Path(checkpoint), path, start)
    method_name = tagged.name if tagged is not None else None
    try:  # the method whose surgery the checkpoint holds (its tag in the config) turns it into its model
        config, weights = export_model(config, model_weights(state))
    except MethodError as exc:
        raise CheckpointError(f'{path}: {exc}') from exc
    # the model is built at the config's size: no larger than the weights the checkpoint holds for it
    check_parameter_budget(config, sum(weight.numel() * weight.element_size() for weight in weights.values()),
                           f'{path} (its Hugging Face config)')
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise CheckpointError(f'{path}: weights do not match the saved config (missing {missing[:5]}, '
                              f'unexpected {unexpected[:5]})')
    model = model.to(getattr(torch, dtype))
    model.config.torch_dtype = getattr(torch, dtype)

    with staged_folder(out_dir, overwrite) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        write_model_card(staging, name=out_dir.name, method=method_name, source=None, start=start,
                         stage=card_stage(f"train: run {state['state'].get('run_name', '?')}",
                                          tokens=_trained_tokens(state),
                                          recipe=record.get('recipe') or state['state'].get('run_name')))
        if getattr(model.config, 'head_map', None) is not None:
            HeadMap.from_dict(model.config.head_map).save(staging / HEAD_MAP_FILE)
        if hf_tokenizer is not None:
            hf_tokenizer.save_pretrained(staging)
    if hf_tokenizer is None:
        print(f'dha-train export: warning: {path} carries no tokenizer; pass --tokenizer to include one')
    return out_dir
