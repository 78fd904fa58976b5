"""fedtrain: fault-tolerant federated and low-communication (DiLoCo) training for PyTorch."""

__version__ = "0.1.0"
