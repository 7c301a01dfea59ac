"""Nano-batch pipeline: the plan format (data) and the executor that builds the step."""
