"""Live metrics of a run: Prometheus endpoints on every role and the trainer's W&B / TensorBoard sinks."""
