"""``specroll launch``: preflight checks, one process group per role, and watching them."""
