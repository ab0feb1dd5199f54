"""Models: HF LLaMA builders and Composer wrappers."""
