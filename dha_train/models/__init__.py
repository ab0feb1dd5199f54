"""Models: the head map, the LLaMA layout helpers, and one self-contained HF modeling file per architecture.

Importing this package registers every ``modeling_*.py`` file's classes with the transformers Auto classes (each
file's ``register_auto_classes()``), so exported folders load with plain ``AutoModelForCausalLM.from_pretrained(dir)``
(no ``trust_remote_code``). A new architecture only adds its modeling file here.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    if _module.name.startswith('modeling_'):
        importlib.import_module(f'{__name__}.{_module.name}').register_auto_classes()
