"""smartinf: near-storage optimizer updates for storage-offloaded LLM training."""
