"""liteboost."""
