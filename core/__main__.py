"""``python -m core``: run an experiment (see ``core.app``)."""

from core.app import main

main()
