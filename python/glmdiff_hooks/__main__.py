"""`python -m glmdiff_hooks ...`: the `glmdiff-hooks` command."""

from .cli import run

run()
