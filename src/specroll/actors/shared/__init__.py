"""What every role and the launcher share: exit codes (``exit_codes.py``), atomic file writes
(``files.py``), the roles' CURVE keys and their ``--keys`` flag (``security.py``, ``keys_flag.py``),
the restart counts the launcher writes and the trainer reports (``restarts.py``), and one wake-up
idiom for tasks (``wakeup.py``)."""
