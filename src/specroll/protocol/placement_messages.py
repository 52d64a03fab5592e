"""The placement channel: ``specroll launch`` and a role's host — a Ray actor that starts and watches
the role's process on its node (``actors/launch/ray_host.py``, ``actors/launch/ray_cluster.py``).

Ray carries the calls; what they carry is these structs, encoded with msgpack to ``bytes`` (and
plain ``int`` / ``str`` replies), so no launcher-defined object is ever pickled by Ray's
serializer and the host refuses a malformed start with a ``msgspec.ValidationError``.
"""

from __future__ import annotations

import msgspec

from specroll.protocol.wire import Positive, WireStruct


class RoleSpec(WireStruct):
    """Start ``python -m module_args...`` as role ``name`` on the host's node.

    Every path is absolute and means the same place on every node (a shared filesystem, or the same
    layout): ``config_text`` is written to ``config_path`` on a node where that file is missing or
    differs, so a role on another node reads the launcher's resolved config.
    """

    name: str
    module_args: tuple[str, ...]
    cwd: str
    """The launcher's working directory: the role's, so relative paths of the config resolve alike
    everywhere (created on a node where it is missing)."""
    log_path: str
    """``RUN_DIR/logs/<role>.log`` on the node: the process's stdout and stderr, appended."""
    config_path: str
    config_text: str
    stale_files: tuple[str, ...] = ()
    """Files of an earlier run removed before the role starts (the trainer's ``RUN_DIR/trainer.endpoint``)."""
    key_files: dict[str, bytes] = msgspec.field(default_factory=dict)
    """With ``network.security = "curve"``: the role's key files (``protocol/curve.py``
    :func:`~specroll.protocol.curve.files_for`), name → content. The host writes them into a folder
    of its own (0700, files 0600, removed when the role is stopped for good) and starts the role
    with ``--keys`` that folder: no node's filesystem holds them readable by others."""


class RoleStarted(WireStruct):
    """The role's process runs: its pid (leader of its own process group) on node ``node_ip``."""

    pid: Positive
    node_id: str
    """Ray's id of the node (hex), for placing other actors beside it."""
    node_ip: str
    """The node's address as Ray knows it (``ray.util.get_node_ip_address()``)."""
    hostname: str
