"""The rollout hub: what generators and drafter trainers connect to, and what every trainer drives
— the built-in GRPO trainer, another RL stack embedding specroll, the HTTP server. Groups go out
to generators by their free capacity and come back streamed, resumable and versioned per token;
policy versions go out as chunks or over collective groups; drafter versions are relayed from the
drafter trainers. The public class is :class:`~specroll.actors.rollout.client.RolloutClient`
(:class:`~specroll.actors.rollout.sync_client.SyncRolloutClient` without an event loop)."""
