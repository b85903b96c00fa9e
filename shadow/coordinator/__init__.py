"""The coordinator: one process that admits workers and trainers, decides which iteration is
committed (the cut), keeps replicas and tiers in step, and answers status and restore queries."""
