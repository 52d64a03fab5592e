"""The rollout hub: what generators and drafter trainers connect to, and what every trainer drives
— the built-in GRPO trainer, another RL stack embedding specroll, the HTTP server. Groups go out
to generators by their free capacity and come back streamed, resumable and versioned per token;
policy versions go out as chunks or over collective groups; drafter versions are relayed from the
drafter trainers. The public class is :class:`~specroll.actors.rollout.client.RolloutClient`
(:class:`~specroll.actors.rollout.sync_client.SyncRolloutClient` without an event loop).

Weights travel as ZeroMQ chunks on the same socket (the default), or with
``weights_transport="collective"`` as bucketed broadcasts over one torch.distributed group per
generator (``weights_groups.py``; announcements and acknowledgements stay on ZeroMQ).

Drafter trainers connect to the same endpoint (``Hello(role="drafter")``); the client feeds them
finished rollouts and the generators' load, and relays their drafter versions to the generators
(:class:`~specroll.actors.rollout.drafter_relay.DrafterRelay`, :attr:`RolloutClient.drafters`).

Inside, three tasks share one :class:`~specroll.protocol.channel.Channel`: a receive loop (which
never waits on a send: replies go through an outgoing queue, so credit grants are always read;
:class:`~specroll.actors.rollout.receive.Receiver`), a sender per peer (``outboxes.py``), and a
ticker (:class:`~specroll.actors.rollout.ticker.Ticker`) that dispatches queued groups by free
capacity and declares peers gone (their groups resume elsewhere from their streamed tokens) when
their connection closes, or after ``heartbeat_timeout_s`` of silence while the client kept up with
its socket (:class:`~specroll.actors.rollout.peers.Peers`, ``liveness.py``; a monitor task watches
the socket's connections).
"""
