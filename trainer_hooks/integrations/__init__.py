"""The shadow in the training frameworks users run: each module imports its framework (an
optional extra: ``pip install "shadow-checkpoint[accelerate]"``, ...), this package none.

* :mod:`trainer_hooks.integrations.accelerate`: Hugging Face accelerate's ``Accelerator``;
* :mod:`trainer_hooks.integrations.hf`: the transformers ``Trainer``;
* :mod:`trainer_hooks.integrations.lightning`: PyTorch Lightning's ``Trainer``.
"""
