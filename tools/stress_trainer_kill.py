"""Stress the trainer-kill scenarios: SIGKILL after an iteration, in the middle of one, and
inside the bootstrap of a resumed run; 20 trials each by default.

    python tools/stress_trainer_kill.py [--trials 20] [--seed 0] [--steps 20] [--json PATH]

Prints the fault-matrix table; exits 1 if any restore was not exact or any trial lost more
iterations than its scenario allows (the kill after an iteration may lose the sender's
in-flight window, at most SHADOW_MAX_LAG; the other two must lose none).
"""

from __future__ import annotations

import sys

from fault_matrix import main

SCENARIOS = "trainer_kill,trainer_kill_mid_iteration,trainer_kill_bootstrap"

if __name__ == "__main__":
    sys.exit(main(default_scenarios=SCENARIOS, default_trials=20, strict=True))
