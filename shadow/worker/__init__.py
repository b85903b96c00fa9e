"""A shadow worker: receives its shard of every gradient, replays the optimizer step on it,
persists it to the tiers and serves it to restores and peer copies."""
