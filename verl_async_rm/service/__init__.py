"""The RM service: one Ray actor per RM, which owns its pool, replicas, batcher and statistics."""
