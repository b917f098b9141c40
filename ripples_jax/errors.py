"""The project's error types, a leaf every floor may import (config.py, the validator, sits high)."""


class ConfigError(ValueError):
  """A config value or an input that is not allowed; str() is the one-line message."""


class ResumeRefused(ConfigError):
  """Checkpoints exist and none can be resumed: nothing was deleted; str() is the one-line message."""


class StorageError(OSError):
  """The run's files cannot be written (disk full, read-only); str() is the one-line message."""


# What a rerun may do when its workdir holds another run (workdir.make_workdir).
ON_CONFIG_CHANGE = ("refuse", "new", "force")
