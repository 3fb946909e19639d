"""The test suite runs the simulated device in strict mode: it behaves as a GPU punishes mistakes (device memory
from empty() is NaN until written), so a test that passes here does not pass by the sim's kindness."""

import os

os.environ.setdefault("MINIOFFLOAD_SIM_STRICT", "1")
