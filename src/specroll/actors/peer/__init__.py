"""What both peer actors share (a generator and the drafter trainer): the lifecycle of a connection
to the trainer, its liveness, the policy-weights fetch and the exit report."""
