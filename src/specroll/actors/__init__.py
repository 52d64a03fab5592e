"""The I/O shell: the ``specroll`` CLI, the generate job, tasks and rewards."""
