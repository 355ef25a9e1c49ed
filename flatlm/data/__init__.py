"""Corpora (tfds array_record builders) and grain input pipelines: masking, batching, host sharding."""
