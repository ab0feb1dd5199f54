"""Import every module that registers loggers, callbacks or algorithms, so recipes can name them."""

import dha_train.algorithms  # noqa: F401
import dha_train.callbacks  # noqa: F401
