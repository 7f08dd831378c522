"""Real checkpoints for demos, tests and benchmarks: located in an installed package, converted
once to a Hugging Face directory, cached. Only files are read; nothing is downloaded."""
