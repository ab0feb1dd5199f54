"""Build a run's HF model of any family (from a local checkpoint or from a config) and wrap it as a Composer model."""

from __future__ import annotations

from pathlib import Path

import torch
from composer.metrics.nlp import LanguageCrossEntropy, LanguagePerplexity
from composer.models import HuggingFaceModel
from transformers import AutoModelForCausalLM

import dha_train.models  # noqa: F401  (registers the DHA and MoH classes with the transformers Auto classes)
from dha_train import families, methods
from dha_train.config import ConfigError, ModelConfig, check_model_config_keys
from dha_train.distributed import causal_lm_on_meta
from dha_train.model_folders import load_causal_lm, load_model_config, safetensors_files
from dha_train.models.llama_layout import is_decoder_block
from dha_train.ops.deepseek import latent_eps_scale, latent_training_eps, scale_latent_rows


def build_model_config(cfg: ModelConfig):
    """The HF config of a run: the pretrained folder's config (if any) with ``cfg.config`` applied on top, or the
    config of the family ``cfg.config['model_type']`` names (LLaMA by default) built from ``cfg.config``."""
    if cfg.pretrained_path is not None:
        path = Path(cfg.pretrained_path)
        if not (path / 'config.json').is_file():
            raise ConfigError(f'model.pretrained_path: no HF config.json in {path} (give a local HF model folder)')
        llama_config = load_model_config(path, who='model.pretrained_path')
        if llama_config.model_type not in methods.trainable_model_types():
            raise ConfigError(f"model.pretrained_path: {path} holds a '{llama_config.model_type}' model; dha_train "
                              f"trains {', '.join(methods.trainable_model_types())} models")
        source_type = families.source_model_type(llama_config)
        check_model_config_keys(cfg.config, source_type if source_type in families.FAMILIES else None)
        if cfg.config.get('model_type', source_type) != source_type:
            raise ConfigError(f"model.config.model_type: {cfg.config['model_type']} differs from the "
                              f"{source_type} model in {path}")
        for key, value in cfg.config.items():
            if key == 'model_type':
                continue
            setattr(llama_config, key, value)
    else:
        if not cfg.config:
            raise ConfigError('model: give model.pretrained_path (a local HF folder) or model.config (config fields '
                              'of a family: model_type, hidden_size, ...)')
        check_model_config_keys(cfg.config)
        fields = dict(cfg.config)
        family = families.get(fields.pop('model_type', 'llama'), 'model.config.model_type')
        llama_config = family.config_class(**fields)
    if llama_config.hidden_size % llama_config.num_attention_heads:
        raise ConfigError(f'model.config: hidden_size={llama_config.hidden_size} is not divisible by '
                          f'num_attention_heads={llama_config.num_attention_heads}')
    llama_config._attn_implementation = cfg.attn_implementation
    return llama_config


def build_model(cfg: ModelConfig, on_meta_device: bool = False):
    """The family's causal LM (or the DHA / MoH / MLA class of a method's export) in fp32; Composer's autocast gives bf16
    compute on GPU.

    ``on_meta_device``: the same model without weights (parameters and buffers on the meta device), for the ranks
    other than global rank 0 when only rank 0 reads the weights (``model.load_on_rank0``): Composer's FSDP2 sees the
    mixed initialisation and broadcasts rank 0's weights while it shards the model.
    """
    llama_config = build_model_config(cfg)
    if cfg.attn_implementation == 'flash_attention_2':
        try:
            import flash_attn  # noqa: F401  (an optional extra: only its presence is checked)
        except ImportError as exc:
            raise ConfigError("model.attn_implementation 'flash_attention_2' needs the optional extra: "
                              "pip install 'dha_train[gpu]'") from exc
    if on_meta_device:
        model = causal_lm_on_meta(llama_config)
    elif cfg.pretrained_path is not None:
        model = load_causal_lm(cfg.pretrained_path, who='model.pretrained_path', config=llama_config,
                               torch_dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(llama_config, torch_dtype=torch.float32)
    if llama_config.model_type == 'deepseek_v3' and cfg.pretrained_path is not None:
        latent_in_training_form(model, Path(cfg.pretrained_path), on_meta_device)
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})
    # FSDP2 shards each decoder layer as its own unit (and the rest of the model as the root unit).
    model.fsdp_wrap_fn = is_decoder_block
    return model


def _folder_tensors(folder: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Named tensors read from a folder's safetensors (one file or an index's shards), not the whole model."""
    from safetensors import safe_open

    tensors = {}
    for file in safetensors_files(folder):
        with safe_open(folder / file, framework='pt') as handle:
            tensors.update({name: handle.get_tensor(name) for name in names if name in handle.keys()})
    return tensors


def latent_in_training_form(model, folder: Path, on_meta_device: bool) -> None:
    """A DeepSeek-format model to the form it trains in: each layer's latent norm at
    ``ops.deepseek.latent_training_eps`` and its latent rows scaled to match (the same function), the eps recorded
    in the config (``methods.LATENT_TRAINING_EPS``) and the model tagged, so that ``export`` scales them back.
    Ranks that build on the meta device read the rows from the folder, so every rank sets the same eps."""
    rank = model.config.kv_lora_rank
    names = [f'model.layers.{index}.self_attn.kv_a_proj_with_mqa.weight'
             for index in range(model.config.num_hidden_layers)]
    stored = _folder_tensors(folder, names) if on_meta_device else None
    training_eps = []
    for index, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        weight = stored[names[index]] if on_meta_device else attention.kv_a_proj_with_mqa.weight.detach()
        eps = latent_training_eps(weight, rank)
        if not on_meta_device:
            with torch.no_grad():
                attention.kv_a_proj_with_mqa.weight.copy_(scale_latent_rows(weight, rank, latent_eps_scale(eps)))
        attention.kv_a_layernorm.variance_epsilon = eps
        training_eps.append(eps)
    setattr(model.config, methods.LATENT_TRAINING_EPS, training_eps)
    methods.tag_method(model.config, 'mla_deepseek')


def wrap_composer(model, tokenizer=None) -> HuggingFaceModel:
    """Composer's HF wrapper: the loss is HF's, metrics are token cross-entropy and perplexity.

    The tokenizer travels inside every checkpoint's metadata, so export needs nothing else.
    """
    return HuggingFaceModel(
        model,
        tokenizer=tokenizer,
        use_logits=True,
        shift_labels=True,
        metrics=[LanguageCrossEntropy()],
        eval_metrics=[LanguageCrossEntropy(), LanguagePerplexity()],
    )
