"""The run configuration: strict structs (``schema.py``), TOML reading and overrides (``parse.py``),
writing (``dump.py``)."""
