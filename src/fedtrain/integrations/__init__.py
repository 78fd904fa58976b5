"""Adapters that federate training loops owned by other libraries (Hugging Face `Trainer`).

Import the submodule you need (`fedtrain.integrations.hf_trainer`): each one imports its
library lazily, so fedtrain itself never requires it.
"""

__all__: list[str] = []
