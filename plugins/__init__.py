"""Built-in method plugins, one module per LLM-for-RL method (see registry.yaml)."""
