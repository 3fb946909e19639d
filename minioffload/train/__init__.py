"""Training a model with the engine: the loop behind `python -m minioffload train` (loop.py), what a run reports
(report.py), and checkpoints, with torch.distributed.checkpoint (checkpoint.py) and lazy asynchronous ones
(checkpoint_async.py).

What this is not: the engine (engine/) or the model (model/).
"""

from .loop import TrainConfig, train

__all__ = ["TrainConfig", "train"]
