"""The hub of a run: a :class:`RolloutClient` built from its config (``[network]``, and ``[trainer]``'s
groups in flight, retry rule and queue capacity), for the trainer process and the server process alike."""

from __future__ import annotations

import logging

from specroll.actors.config import RunConfig
from specroll.actors.rollout.client import RolloutClient
from specroll.actors.rollout.timeline import Timeline
from specroll.actors.rollout.weights_groups import BackendChoice

log = logging.getLogger("specroll.client")


def bind_address(config: RunConfig) -> str:
    """``tcp://network.host:network.trainer_port`` (an IPv6 literal in brackets)."""
    host = config.network.host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{config.network.trainer_port}"


def weights_backend(config: RunConfig) -> BackendChoice:
    """``network.weights_backend``, with ``auto`` made gloo for a trainer on the CPU (NCCL would
    need its rank 0 on a GPU, whatever devices the machine has)."""
    backend = config.network.weights_backend
    return "gloo" if backend == "auto" and config.trainer.device == "cpu" else backend


def client_from_config(config: RunConfig, timeline: Timeline | None) -> RolloutClient:
    """The run's hub (not started), with its CURVE keys when ``network.security = "curve"``; logs
    the security in use and the insecure-bind warning.

    Raises:
        KeysError: the run's keys cannot be read.
    """
    net = config.network
    keys = net.server_keys(config.run_dir)
    if keys is not None:
        log.info("CURVE security: admitting this run's generator and drafter keys from %s",
                 net.keys_path(config.run_dir))
    if net.insecure_warning() is not None:
        log.warning("%s", net.insecure_warning())
    tc = config.trainer
    return RolloutClient(bind_address(config), max_groups_in_flight=tc.max_groups_in_flight,
                         max_group_retries=tc.max_group_retries, max_queued_groups=tc.max_queued_groups,
                         heartbeat_timeout_s=net.heartbeat_timeout_s, window=net.window, hwm=net.hwm,
                         allow_public=net.public_bind_allowed(), curve=keys, timeline=timeline,
                         weights_transport=net.weights_transport, weights_bucket_mb=net.weights_bucket_mb,
                         weights_backend=weights_backend(config))
