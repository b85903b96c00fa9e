"""Writing a checkpoint (a :class:`~shadow.core.snapshot.Snapshot`) out in standard formats: a
torch state-dict file, a ``torch.distributed.checkpoint`` directory, or safetensors.

Importing this package imports no torch: the writers import it when they run, after their
arguments are checked, and raise :class:`TorchMissingError` (naming
``pip install 'shadow-checkpoint[trainer]'``) on a host without it. The modules that need
torch at import (:mod:`~shadow.export.blob`: the commit-blob codec;
:mod:`~shadow.export.extras`: the model state outside the optimizer;
:mod:`~shadow.export.state`: ``state_dicts``) are loaded only by the writers and by
``trainer_hooks``; nothing on the service's path imports them.
"""

from shadow.export._torch import INSTALL_TRAINER, TorchMissingError, require_torch
from shadow.export._writers import DTYPES, FORMATS, WEIGHT_FORMATS, check_out, export, export_weights

__all__ = [
    "DTYPES",
    "FORMATS",
    "INSTALL_TRAINER",
    "WEIGHT_FORMATS",
    "TorchMissingError",
    "check_out",
    "export",
    "export_weights",
    "require_torch",
]
