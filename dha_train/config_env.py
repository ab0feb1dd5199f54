"""What ``${oc.env:NAME}`` gave a recipe, kept out of the config as it is saved and logged.

A recipe or an override may take values from the environment (data paths, run names, a logger's entity): the run
uses the environment's value, and ``dha_train_config.json`` and the logged hyper-parameters show the expression
``${oc.env:NAME}`` in its place, in every value it went into (directly, through ``${variables.x}``, or inside a
longer string). The config is resolved a second time with each ``oc.env`` call giving its own expression; the values
that differ between the two resolutions are the ones shown with it.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

# In the second resolution: oc.env gives its expression; oc.decode and oc.create, which would resolve that expression
# again (and so give the environment's value after all), pass it on as it is.
_SHOWN_RESOLVERS = {'oc.env': lambda name, default=None: f'${{oc.env:{name}}}' if default is None else
                    f'${{oc.env:{name},{default}}}',
                    'oc.decode': lambda value: value, 'oc.create': lambda value: value}
_SHOWN_CALL = re.compile(r'\$\{\s*(oc\.(?:env|decode|create))\s*:')
with warnings.catch_warnings():  # omegaconf 2.4 deprecates the name 2.3 has (register_new_resolver), and keeps it
    warnings.simplefilter('ignore')
    for _name, _resolver in _SHOWN_RESOLVERS.items():
        if not OmegaConf.has_resolver(f'dha_train.shown.{_name}'):
            OmegaConf.register_new_resolver(f'dha_train.shown.{_name}', _resolver)


def env_values(raw: dict, unresolved: dict) -> dict[tuple, tuple[Any, Any]]:
    """{key path: (value the run uses, value as shown)} for each value of the resolved config ``raw`` that an
    ``${oc.env:...}`` of the unresolved config went into; {} for a config without one."""
    if 'oc.env' not in repr(unresolved):
        return {}
    try:
        shown = OmegaConf.to_container(OmegaConf.create(_with_shown_calls(unresolved)), resolve=True)
    except OmegaConfBaseException:  # a resolver that refuses an expression for a value: show every value as written
        shown = _with_shown_calls(unresolved, written=True)
    return dict(_differences(raw, shown, ()))


def show_env_values(data: dict, values: dict[tuple, tuple[Any, Any]]) -> dict:
    """``data`` (the config as plain data) with each of ``values`` shown as written; a value changed since the config
    was loaded is left as it is now."""
    for path, (value, shown) in values.items():
        *parents, last = path
        holder: Any = data
        for key in parents:
            holder = _child(holder, key)
        current = _child(holder, last)
        if current is not None and str(current) == str(value):
            holder[last] = shown
    return data


def _child(holder: Any, key: Any) -> Any:
    if isinstance(holder, dict):
        return holder.get(key)
    if isinstance(holder, list) and isinstance(key, int) and 0 <= key < len(holder):
        return holder[key]
    return None


def _with_shown_calls(value: Any, written: bool = False) -> Any:
    """The unresolved config with each ``_SHOWN_RESOLVERS`` call made its shown form (``written``: each value holding
    an interpolation kept as written)."""
    if isinstance(value, dict):
        return {key: _with_shown_calls(item, written) for key, item in value.items()}
    if isinstance(value, list):
        return [_with_shown_calls(item, written) for item in value]
    if written or not isinstance(value, str) or '${' not in value:
        return value
    return _SHOWN_CALL.sub(lambda call: f'${{dha_train.shown.{call.group(1)}:', value)


def _differences(real: Any, shown: Any, path: tuple):
    """(path, (real value, shown value)) at each place where the two resolutions differ."""
    if isinstance(real, dict) and isinstance(shown, dict) and real.keys() == shown.keys():
        for key in real:
            yield from _differences(real[key], shown[key], (*path, key))
    elif isinstance(real, list) and isinstance(shown, list) and len(real) == len(shown):
        for index, (item, shown_item) in enumerate(zip(real, shown)):
            yield from _differences(item, shown_item, (*path, index))
    elif real != shown:
        yield path, (real, shown)
