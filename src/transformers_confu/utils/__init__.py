"""Low-level helpers shared by every part: atomic file writes, KV-cache utilities, oneDNN CPU kernels."""
