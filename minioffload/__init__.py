"""minioffload: a small, real runtime for training models larger than GPU memory.

Each module is one piece the course builds: `memory` (byte accounting), `viz` (figures),
`widgets` (interactive wrappers over the figures), `check` (lab verdicts). Later chapters add the
device, streams, CPU Adam, the offload engine and the NVMe swapper.
"""

__version__ = "0.1.0"
