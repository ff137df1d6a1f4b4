"""Hugging Face format: a checkpoint exported as a standard architecture for vLLM and transformers."""
