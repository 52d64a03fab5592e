"""The one error of config loading, in a module of its own so every config module can raise it."""


class ConfigError(ValueError):
    """A config file, an override or a value is not acceptable; the message names the file and dotted key."""
