"""dha_train's own Composer callbacks. Importing this package imports every module in it, and each registers its
callback in ``dha_train.registry.callbacks``: a new callback only adds its module here."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f'{__name__}.{_module.name}')
