"""A shared cluster: several jobs at once, each with a coordinator and workers of its own (docs/operations.md)."""
