"""Process exit codes of every specroll role, defined once.

=====  ================================  ==========================================================
code   name                              meaning per role
=====  ================================  ==========================================================
0      :data:`EXIT_OK`                   trainer: trained ``steps`` steps (or nothing left to do);
                                         generator, drafter trainer: stopped by SIGTERM/SIGINT, or
                                         the trainer ended for good; launcher: the trainer finished
1      :data:`EXIT_FAILED`               any role: an internal failure (logged with its traceback);
                                         launcher: a role died or the run could not go on
2      :data:`EXIT_REFUSED`              trainer, launcher, ``specroll`` commands: bad input (a config
                                         file, an override, a flag, a model that does not load);
                                         generator, drafter trainer: that, or the trainer refused
                                         it (protocol version, a duplicate id, another model)
3      :data:`EXIT_PEER_LOST`            the peer the role depends on is unreachable: for a generator
                                         or the drafter trainer, no Welcome or no message from the
                                         trainer within the timeout; for the trainer, no generator
                                         for ``NO_GENERATOR_FACTOR × network.heartbeat_timeout_s``
=====  ================================  ==========================================================

(130, the shell's code for SIGINT, is what ``specroll launch`` returns when interrupted.)
"""

from __future__ import annotations

EXIT_OK = 0
"""Done, or stopped on request."""
EXIT_FAILED = 1
"""An internal failure."""
EXIT_REFUSED = 2
"""Bad input or config, or refused by the trainer."""
EXIT_PEER_LOST = 3
"""The peer this role depends on is unreachable (the trainer for a peer, every generator for the trainer)."""
