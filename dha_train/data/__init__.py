"""Data: RedPajama JSONL -> tokenized MDS shards per domain, streaming loaders, tokenizers, the quickstart corpus."""
