"""Model definitions (one architecture family per file), the registry and the checkpoint loader."""
