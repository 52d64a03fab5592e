"""Pure RL maths: GRPO advantages and losses, the training step, tasks and rewards, and the rollout
coordinator's state machine. No sockets, no processes, no event loop."""
