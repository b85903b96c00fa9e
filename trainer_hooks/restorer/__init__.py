"""What restores: a checkpoint into a model and optimizer, in place, and where each optimizer was last restored to."""
