"""Model backends (the torch reference for Hugging Face checkpoints arrives with its issue)."""
