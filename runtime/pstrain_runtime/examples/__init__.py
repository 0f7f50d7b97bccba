"""Example tasks for `spec.training.entrypoint`: digits (small, real data) and
synthetic (large, to stress the transport)."""
