"""dha_train's Composer algorithms. Importing this package imports every module in it, and each registers its
algorithm in ``dha_train.registry.algorithms``: a new algorithm only adds its module here."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f'{__name__}.{_module.name}')
