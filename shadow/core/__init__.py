"""What every part of the shadow shares: the flat layout, the errors callers see, job
names, snapshots, the trainer's square-root table and the param groups' replay settings."""
