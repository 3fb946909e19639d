"""`python -m minioffload COMMAND ...`: the command line lives in minioffload/cli/."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
