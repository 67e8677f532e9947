"""`scaletrain eval`: lm-evaluation-harness tasks on our models, in-process."""
