"""The trainer as N torch.distributed ranks: who is which rank and the group they join
(``join.py``), rank 0's commands to the others (``channel.py``), the FSDP2 model they share
(``sharded.py``), what a rank > 0 runs (``follower.py``) and the rank flags (``flags.py``)."""
