"""``specroll launch``'s entry: check the config, the Ray cluster and the run directory, take the
run's lock, size the CPU budget, then run a :class:`~specroll.actors.launch.launch.Launcher`."""

from __future__ import annotations

import sys
from pathlib import Path

from specroll.actors.config import ConfigError, RunConfig, load_config
from specroll.actors.launch.cpu_budget import available_cores, budget_line, with_cpu_budget
from specroll.actors.launch.errors import LaunchError
from specroll.actors.launch.launch import Launcher
from specroll.actors.launch.preflight import LOCK_FILENAME, preflight, take_lock
from specroll.actors.launch.ray_cluster import RayCluster, check_supported, import_ray, resources_line, with_ray_threads
from specroll.actors.launch.role_fork import fork_supported, prepare
from specroll.actors.launch.role_starts import DRAFTER_MODULE, GENERATOR_MODULE, TRAINER_MODULE
from specroll.actors.launch.trainer_endpoint import ENDPOINT_FILENAME
from specroll.actors.shared.exit_codes import EXIT_REFUSED
from specroll.protocol.curve import KeysError, init_keys


def prepare_keys(config: RunConfig) -> str | None:
    """With ``network.security = "curve"``: make the run's keys on the first start (kept after), and
    check that every role's keys load; returns the line to say (None without CURVE).

    Raises:
        KeysError: an incomplete keys folder, or a key file missing, unreadable, exposed or malformed.
    """
    net = config.network
    if net.security != "curve":
        return None
    directory = net.keys_path(config.run_dir)
    made = init_keys(directory)
    net.server_keys(config.run_dir)
    for role in ("generator", *(("drafter",) if config.runs_drafter_trainer() else ())):
        net.client_keys(config.run_dir, role)
    return f"CURVE security: {'made' if made else 'using'} the run's keys in {directory}"


def run_launch(config_path: str, overrides: list[str], *, trainer_module: str = TRAINER_MODULE,
               startup_timeout_s: float = 300.0, grace_s: float = 15.0, serving: bool = False) -> int:
    """``specroll launch``: validate the config (one error line and exit 2, nothing started), run.
    ``serving``: ``specroll serve`` (``trainer_module`` is the server's; nothing is trained); its
    errors say so."""
    prog = "specroll serve" if serving else "specroll launch"
    try:
        config = load_config(config_path, overrides)  # every role reads this same config: checked once here
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    on_ray = config.cluster.backend == "ray"
    if on_ray:
        try:
            check_supported(config)
            import_ray()
        except LaunchError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return e.code
    forker = None
    if config.launch.fork_roles and fork_supported() and not on_ray:  # before the preflight touches a tensor
        forker = prepare([trainer_module, GENERATOR_MODULE, DRAFTER_MODULE])
    try:
        done = preflight(config, serving)
    except LaunchError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    if done is not None:
        print(f"specroll launch: {done}", file=sys.stderr)
        return 0
    lock = Path(config.run_dir) / LOCK_FILENAME
    try:
        take_lock(lock)
    except LaunchError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    cores = available_cores()
    config = with_ray_threads(config) if on_ray else with_cpu_budget(config, cores)
    try:
        try:
            keys_line = prepare_keys(config)
        except KeysError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return EXIT_REFUSED
        launcher = Launcher(config, trainer_module=trainer_module, startup_timeout_s=startup_timeout_s,
                            grace_s=grace_s, forker=forker, warm_start=not serving)
        if on_ray:
            launcher.cluster = RayCluster(config, launcher.say, Path(config.run_dir) / ENDPOINT_FILENAME)
        launcher.say(resources_line(config) if on_ray else budget_line(config, cores))
        if keys_line:
            launcher.say(keys_line)
        for warning in config.warnings():
            launcher.say(f"warning: {warning}")
        return launcher.run()
    finally:
        lock.unlink(missing_ok=True)


