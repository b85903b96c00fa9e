"""``python -m shadow.testing.faulty <shadow command> ...``: the ``shadow`` command with the
service faults that ``SHADOW_FAULT_*`` names installed (:mod:`shadow.testing.faults`);
a cluster started this way spawns its workers through this entry point too. Tests only."""

from __future__ import annotations

import sys

from shadow.cli import _services
from shadow.cli.main import main
from shadow.testing import faults

if __name__ == "__main__":
    faults.install(faults.ServiceFaults.from_env())
    _services.WORKER_ENTRY = "shadow.testing.faulty"
    sys.exit(main())
