"""``python -m mqorder.cli``: the same as the ``mqorder`` script, without installing it."""

from mqorder.cli import main

main()
