"""Build a HF LLaMA (from a local checkpoint or from a config) and wrap it as a Composer model."""

from __future__ import annotations

from pathlib import Path

from dha_train.config import ConfigError, ModelConfig, unknown_key_error


def check_llama_config_keys(overrides: dict) -> None:
    """Every key of ``model.config`` must be a LlamaConfig field."""
    from transformers import LlamaConfig

    valid = set(LlamaConfig().to_dict())
    for key in overrides:
        if key not in valid:
            raise unknown_key_error('model.config', key, valid)


def build_llama_config(cfg: ModelConfig):
    """The LlamaConfig of a run: the pretrained folder's config (if any) with ``cfg.config`` applied on top."""
    from transformers import AutoConfig, LlamaConfig

    import dha_train.models  # noqa: F401  (registers the DHA classes with AutoConfig)

    check_llama_config_keys(cfg.config)
    if cfg.pretrained_path is not None:
        path = Path(cfg.pretrained_path)
        if not (path / 'config.json').is_file():
            raise ConfigError(f'model.pretrained_path: no HF config.json in {path} (give a local HF model folder)')
        llama_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        if llama_config.model_type not in ('llama', 'dha_llama', 'moh_llama'):
            raise ConfigError(f"model.pretrained_path: {path} holds a '{llama_config.model_type}' model; "
                              'dha_train trains LLaMA, DHA-LLaMA and MoH-LLaMA models')
        for key, value in cfg.config.items():
            setattr(llama_config, key, value)
    else:
        if not cfg.config:
            raise ConfigError('model: give model.pretrained_path (a local HF folder) or model.config (LlamaConfig fields)')
        llama_config = LlamaConfig(**cfg.config)
    if llama_config.hidden_size % llama_config.num_attention_heads:
        raise ConfigError(f'model.config: hidden_size={llama_config.hidden_size} is not divisible by '
                          f'num_attention_heads={llama_config.num_attention_heads}')
    llama_config._attn_implementation = cfg.attn_implementation
    return llama_config


def build_llama(cfg: ModelConfig):
    """A ``LlamaForCausalLM`` (or ``DhaLlamaForCausalLM`` for a head-mapped checkpoint) in fp32; Composer's
    autocast gives bf16 compute on GPU."""
    import torch
    from transformers import AutoModelForCausalLM

    llama_config = build_llama_config(cfg)
    if cfg.attn_implementation == 'flash_attention_2':
        try:
            import flash_attn  # noqa: F401
        except ImportError as exc:
            raise ConfigError("model.attn_implementation 'flash_attention_2' needs the optional extra: "
                              "pip install 'dha_train[gpu]'") from exc
    if cfg.pretrained_path is not None:
        model = AutoModelForCausalLM.from_pretrained(cfg.pretrained_path, config=llama_config,
                                                     local_files_only=True, torch_dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(llama_config, torch_dtype=torch.float32)
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})
    # FSDP2 shards each decoder layer as its own unit (and the rest of the model as the root unit).
    model.fsdp_wrap_fn = is_fsdp_block
    return model


def is_fsdp_block(module) -> bool:
    # By class name, so attention variants that subclass or replace the decoder layer are wrapped the same way.
    return type(module).__name__.endswith('DecoderLayer')


def wrap_composer(model, tokenizer=None):
    """Composer's HF wrapper: the loss is HF's, metrics are token cross-entropy and perplexity.

    The tokenizer travels inside every checkpoint's metadata, so export needs nothing else.
    """
    from composer.metrics.nlp import LanguageCrossEntropy, LanguagePerplexity
    from composer.models import HuggingFaceModel

    return HuggingFaceModel(
        model,
        tokenizer=tokenizer,
        use_logits=True,
        shift_labels=True,
        metrics=[LanguageCrossEntropy()],
        eval_metrics=[LanguageCrossEntropy(), LanguagePerplexity()],
    )
