"""Small models built from code with random weights, for the mfusion benchmark (no downloads)."""
