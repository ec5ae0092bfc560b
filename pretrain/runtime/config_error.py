"""`ConfigError`, the error of a configuration the user must fix, in a module of its own.

The runtime's config machinery (`pretrain/runtime/config.py`) and every stage's config raise it for the config
they load and check; `pretrain.config` re-exports it (`from pretrain.config import ConfigError` is the usual
spelling in pretraining). The methods (`pretrain/methods/`) raise it from their `check_config` and for batches
they cannot train on, and import it from here, which imports nothing of the project: the config imports the
methods, so the methods cannot import the config back.
"""


class ConfigError(ValueError):
    """A configuration the user must fix; the message says what and how."""
