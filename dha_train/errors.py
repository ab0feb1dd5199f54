"""The one base of every error a user can cause (bad config, data, checkpoint, head map, arguments).

``dha-train`` and ``python -m dha_train.train`` catch ``DhaTrainError`` and print its message as one line (exit 2);
anything else is a bug and keeps its traceback. Imports nothing, so every layer above ``ops`` may use it.
"""


class DhaTrainError(Exception):
    """A problem with the user's input, with the offending key, path or value named in the message."""


class OutputExistsError(DhaTrainError, FileExistsError):
    """An output folder or file exists and would be replaced without being asked to."""


class InputNotFoundError(DhaTrainError, FileNotFoundError):
    """A model, data or recipe path that was given does not exist."""
