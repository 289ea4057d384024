"""mfusion."""
