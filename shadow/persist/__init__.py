"""Persistence tiers: shard files, manifests, the catalog of checkpoints on storage."""
