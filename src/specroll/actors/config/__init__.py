"""The run configuration: strict structs (``schema.py``), TOML reading and overrides (``parse.py``, ``load.py``),
writing (``dump.py``), the one error (``errors.py``); this package re-exports what callers use."""

from specroll.actors.config.cluster_section import ClusterConfig, RoleResources
from specroll.actors.config.dump import CONFIG_FILENAME, dump_config, toml_value, write_resolved
from specroll.actors.config.errors import ConfigError
from specroll.actors.config.launch_section import LaunchConfig
from specroll.actors.config.load import load_config
from specroll.actors.config.network_section import NetworkConfig
from specroll.actors.config.schema import (
    DrafterConfig,
    GeneratorConfig,
    ModelSection,
    RunConfig,
    TaskConfig,
    TrainerConfig,
)

__all__ = [
    "CONFIG_FILENAME",
    "ClusterConfig",
    "ConfigError",
    "DrafterConfig",
    "GeneratorConfig",
    "LaunchConfig",
    "ModelSection",
    "NetworkConfig",
    "RoleResources",
    "RunConfig",
    "TaskConfig",
    "TrainerConfig",
    "dump_config",
    "load_config",
    "toml_value",
    "write_resolved",
]
