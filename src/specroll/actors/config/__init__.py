"""The run configuration: strict structs — the whole run (``run_config.py``) and one module per section
(``model_section.py``, ``task_section.py`` with ``[eval]``, ``trainer_section.py``, ``generator_section.py``,
``drafter_section.py``, ``network_section.py``, ``launch_section.py``, ``cluster_section.py``; their shared
base in ``section.py``) —, TOML reading and overrides (``parse.py``, ``load.py``), writing (``dump.py``), the
one error (``errors.py``); this package re-exports what callers use."""

from specroll.actors.config.cluster_section import ClusterConfig, RoleResources
from specroll.actors.config.drafter_section import DrafterConfig
from specroll.actors.config.dump import CONFIG_FILENAME, dump_config, toml_value, write_resolved
from specroll.actors.config.errors import ConfigError
from specroll.actors.config.generator_section import GeneratorConfig
from specroll.actors.config.launch_section import LaunchConfig
from specroll.actors.config.load import load_config
from specroll.actors.config.model_section import ModelSection
from specroll.actors.config.network_section import NetworkConfig
from specroll.actors.config.run_config import RunConfig
from specroll.actors.config.task_section import TaskConfig
from specroll.actors.config.trainer_section import TrainerConfig

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
