"""Data: text prepared into verified token shards (prepare, tokenizer, manifest) and the loader that
reads them (loader)."""
