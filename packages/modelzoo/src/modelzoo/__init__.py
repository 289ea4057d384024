"""modelzoo."""
