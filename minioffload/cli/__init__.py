"""The command line: `python -m minioffload COMMAND` (main.py), the `plan` command (plan.py) and the argument types the
commands share (args.py).

What this is not: where anything is computed; each command calls the package that owns it.
"""
